"""Court judgments in the CAIL2020 summarisation format: reading, sentence splitting, scores, oracle labels.

- `read_judgments`: CAIL2020 JSONL (`id`, `summary`, `text: [{sentence, label}]`), JSONL with a
  `text` string, `.txt` files and folders of them, each file decoded whole (`documents.read_text`).
  Malformed lines are reported with file and line number and skipped; `read_predictions` reads
  `{id, summary}` lines and refuses any it cannot use.
- `split_sentences`: a splitter for Chinese legal text (after 。！？； and line breaks, closing
  quotes and brackets kept with their sentence).
- `rouge_scores` / `cail_score`: ROUGE-1/2/L F as the `rouge` package defines them (its ROUGE-L
  computed here without its recursion), over characters or jieba words, and the CAIL score
  `0.2 R1 + 0.4 R2 + 0.4 RL`.
- `oracle_labels`: which sentences to extract when a document has a reference summary but no
  labels (greedy on the CAIL score over characters).
"""

import re
import sys
from dataclasses import dataclass, field

import numpy as np

from .documents import (
    InputFile,
    is_blank,
    is_jsonl,
    iter_jsonl,
    jieba_words,
    read_files,
    read_input_text,
    record_id,
    refused_files,
    report_problem,
)

# A sentence ends after one of these, together with any closing quotes or brackets that follow.
_SENTENCE_END = re.compile(r"([。！？；!?;]+[”’」』）)]*|\n+)")
UNITS = ("char", "word")


@dataclass
class Judgment:
    """One document: its sentences, their extraction labels (if known) and reference summary (if known)."""

    id: str
    sentences: list[str]
    labels: list[int] | None = None
    summary: str | None = None
    source: str = field(default="", repr=False)

    @property
    def text(self) -> str:
        return "".join(self.sentences)


def split_sentences(text: str) -> list[str]:
    """Split Chinese legal text into sentences; joining them gives back the text without blank lines."""
    pieces, start = [], 0
    for match in _SENTENCE_END.finditer(text):
        piece = text[start : match.end()].strip()
        if piece:
            pieces.append(piece)
        start = match.end()
    tail = text[start:].strip()
    if tail:
        pieces.append(tail)
    return pieces


def _judgment_from_record(record: dict, path, number: int, problems) -> Judgment | None:
    text, summary = record.get("text"), record.get("summary")
    if summary is not None and not isinstance(summary, str):
        report_problem(problems, path, number, '"summary" is not a string')
        return None
    identifier = record_id(record, path, number)
    if identifier is None:
        report_problem(problems, path, number, '"id" is neither a string nor an integer')
        return None
    if isinstance(text, str) and not is_blank(text):
        return Judgment(identifier, split_sentences(text), None, summary, f"{path}:{number}")
    if isinstance(text, list) and text:
        sentences, labels = [], []
        for item in text:
            if not isinstance(item, dict) or not isinstance(item.get("sentence"), str):
                report_problem(problems, path, number, '"text" items must be {"sentence": str, "label": 0|1}')
                return None
            sentences.append(item["sentence"])
            labels.append(item.get("label"))
        if all(is_blank(sentence) for sentence in sentences):  # nothing to summarise
            report_problem(problems, path, number, 'every sentence of "text" is empty or blank')
            return None
        if any(label not in (0, 1) for label in labels):
            labels = None if all(label is None for label in labels) else labels
            if labels is not None:
                report_problem(problems, path, number, '"label" values must be 0 or 1')
                return None
        return Judgment(identifier, sentences, labels, summary, f"{path}:{number}")
    report_problem(problems, path, number, 'no "text" (a string, or a list of {"sentence", "label"})')
    return None


# Real judgments are 866 to 13,064 characters (CAIL2020); far longer inputs are refused before any work.
MAX_CHARACTERS = 100_000


def read_judgments(paths, problems: list | None = None, max_characters: int | None = MAX_CHARACTERS,
                   encoding: str | None = None) -> list[Judgment]:
    """Judgments from CAIL2020 JSONL, JSONL with a `text` string, `.txt` files (one judgment each) and folders.

    Files are read as `documents.read_files` reads them: each decoded whole (`documents.read_text`; `encoding`, e.g.
    `"gb18030"`, names the encoding of files that are not UTF-8 or UTF-16), and one that cannot be used (its
    encoding, its kind, a `.txt` with no text) is an `InputFileError` when named directly, or reported in `problems`
    and left out when found in a folder. Malformed JSONL lines, and records whose sentences are all blank, are
    reported in `problems` (file and line) and skipped.

    A `.txt` judgment's id is its path below the folder named (`2019/001` for `judgments/2019/001.txt`), or its
    name when the file is named itself; a JSONL record's is its `id` (else `file:line`). Two judgments with one id
    are a `ValueError` naming both, as is a judgment longer than `max_characters` (None: no limit): the time of
    attention grows with the square of the length, and real judgments are far shorter.
    """
    def read(file: InputFile) -> list[Judgment]:
        if not is_jsonl(file.path):
            return [Judgment(file.name, split_sentences(read_input_text(file.path, encoding)), source=str(file.path))]
        judgments = (_judgment_from_record(record, file.path, number, problems)
                     for number, record in iter_jsonl(file.path, problems, encoding))
        return [judgment for judgment in judgments if judgment is not None]

    judgments = read_files(paths, read, problems)
    sources = {}
    for judgment in judgments:
        if judgment.id in sources:
            raise ValueError(f"Two judgments have the id {judgment.id!r}: {sources[judgment.id]} and {judgment.source}. "
                             "Give them distinct ids (or file names).")
        sources[judgment.id] = judgment.source
        if max_characters is not None and len(judgment.text) > max_characters:
            raise ValueError(f"{judgment.source} ({judgment.id}) has {len(judgment.text):,} characters, more than the "
                             f"{max_characters:,} accepted (real judgments have up to about 13,000): "
                             "pass --max-characters to raise the limit.")
    return judgments


def read_command_inputs(paths, max_characters: int | None = None,
                        encoding: str | None = None) -> tuple[list[Judgment], int]:
    """`read_judgments` as the commands read their inputs: each skipped line and each file left out said on standard
    error (a line each, as the command line says everything; not a log record, which a program's logging setup could
    send elsewhere), then how many files were left out; no judgment at all is a `ValueError`. Returns the judgments
    and the number of files left out, for a command to repeat at its end (`input_files` words it).
    `max_characters` None: `MAX_CHARACTERS`."""
    problems = []
    judgments = read_judgments(paths, problems, max_characters or MAX_CHARACTERS, encoding)
    for problem in problems:
        print(f"skipped {problem}", file=sys.stderr)
    refused = len(refused_files(problems))
    if refused:
        print(f"left out {input_files(refused)} (named above); the rest was read", file=sys.stderr)
    if not judgments:
        raise ValueError(f"No judgments found in {', '.join(map(str, paths))}.")
    return judgments, refused


def input_files(count: int) -> str:
    """`count` input file(s), in words."""
    return f"{count} input file{'s' if count != 1 else ''}"


def read_predictions(path, encoding: str | None = None) -> dict[str, str]:
    """The summaries in a predictions file (a JSON object `{"id": ..., "summary": ...}` per line, as `summarize`
    writes them), by id.

    The file is decoded whole (`documents.read_text`; `encoding` as for `read_judgments`), and every line must be
    used: a malformed line (not JSON, not an object, an `id` missing or neither a string nor an integer, a `summary`
    missing or not a string) or a second line with an id already given (ids are matched as text: `1` and `"1"` are
    one id) is a `ValueError` naming the file and lines. Blank lines are passed over.
    """
    problems, predictions, lines = [], {}, {}
    for number, record in iter_jsonl(path, problems, encoding):
        # A prediction without an id matches no judgment (`record_id` would name it after its line).
        identifier = None if record.get("id") is None else record_id(record, path, number)
        summary = record.get("summary")
        if identifier is None:
            report_problem(problems, path, number, '"id" is missing, or neither a string nor an integer')
        elif not isinstance(summary, str):
            report_problem(problems, path, number, '"summary" is missing, or not a string')
        elif identifier in lines:
            raise ValueError(f"{path}:{lines[identifier]} and {path}:{number} both give a summary of {identifier!r}: "
                             "keep one prediction per id.")
        else:
            lines[identifier], predictions[identifier] = number, summary
    if problems:
        listed = "; ".join(map(str, problems[:3])) + ("; ..." if len(problems) > 3 else "")
        raise ValueError(f"{path} has {len(problems)} malformed line{'s' if len(problems) > 1 else ''}, none of it "
                         f"scored: {listed}")
    return predictions


def _tokens(text: str, unit: str) -> str:
    if unit == "char":
        return " ".join(ch for ch in text if not ch.isspace())
    if unit == "word":
        return " ".join(word for word in jieba_words(text) if word.strip())
    raise ValueError(f"unit must be one of {UNITS}, got {unit!r}.")


def _sentences(tokens: str) -> list[list[str]]:
    """The `rouge` package's split of a space-separated token string: sentences at ".", then words at spaces
    (as it does, a sentence of blanks between two dots counts, as one empty word)."""
    return [" ".join(part.split()).split(" ") for part in tokens.split(".") if part]


def _lcs_tokens(reference: list[str], candidate: list[str]) -> set[str]:
    """The tokens of the longest common subsequence the `rouge` package finds (same table, same tie-breaking),
    computed without recursion: its recursive backtrack overflows Python's stack on texts of ~1,000 tokens."""
    vocabulary = {token: index for index, token in enumerate(dict.fromkeys(reference + candidate))}
    x = np.array([vocabulary[t] for t in reference], dtype=np.int64)
    y = np.array([vocabulary[t] for t in candidate], dtype=np.int64)
    table = np.zeros((len(x) + 1, len(y) + 1), dtype=np.int32)
    for i in range(1, len(x) + 1):  # a row at a time: LCS rows are non-decreasing, so a running maximum fills them
        matched = np.where(y == x[i - 1], table[i - 1, :-1] + 1, 0)
        table[i, 1:] = np.maximum.accumulate(np.maximum(table[i - 1, 1:], matched))
    tokens, i, j = set(), len(x), len(y)
    while i > 0 and j > 0:
        if x[i - 1] == y[j - 1]:
            tokens.add(reference[i - 1])
            i, j = i - 1, j - 1
        elif table[i - 1, j] > table[i, j - 1]:
            i -= 1
        else:
            j -= 1
    return tokens


def rouge_l(candidate_tokens: str, reference_tokens: str) -> float:
    """The `rouge` package's ROUGE-L F (summary level: union LCS over sentences, unique tokens), iteratively."""
    candidate, reference = _sentences(candidate_tokens), _sentences(reference_tokens)
    union, overlap = set(), 0
    for reference_sentence in reference:
        before = len(union)
        for candidate_sentence in candidate:
            union |= _lcs_tokens(reference_sentence, candidate_sentence)
        overlap += len(union) - before
    return f_score(overlap, len({t for sentence in candidate for t in sentence}),
                   len({t for sentence in reference for t in sentence}))


def f_score(overlap: int, evaluated: int, referenced: int) -> float:
    """The `rouge` package's F1 from an overlap and the two sizes (0 for an empty side)."""
    precision = overlap / evaluated if evaluated else 0.0
    recall = overlap / referenced if referenced else 0.0
    return 2.0 * ((precision * recall) / (precision + recall + 1e-8))


def rouge_scores(candidate: str, reference: str, unit: str = "char", metrics=("rouge-1", "rouge-2", "rouge-l")) -> dict[str, float]:
    """ROUGE F1 scores of one candidate, over characters or jieba words.

    ROUGE-1 and ROUGE-2 come from the `rouge` package; ROUGE-L is that package's definition computed
    by `rouge_l` (the package's own recursion fails on long texts). An empty candidate or reference
    scores 0. With all three metrics, also returns `cail`, the CAIL2020 score.
    """
    from rouge import Rouge

    hypothesis, reference_tokens = _tokens(candidate, unit), _tokens(reference, unit)
    if not _sentences(hypothesis) or not _sentences(reference_tokens):
        scores = dict.fromkeys(metrics, 0.0)
    else:
        ngram_metrics = [name for name in metrics if name != "rouge-l"]
        result = Rouge(metrics=ngram_metrics).get_scores(hypothesis, reference_tokens)[0] if ngram_metrics else {}
        scores = {name: result[name]["f"] if name != "rouge-l" else rouge_l(hypothesis, reference_tokens)
                  for name in metrics}
    if len(scores) == 3:
        scores["cail"] = cail_score(scores)
    return scores


def cail_score(scores: dict[str, float]) -> float:
    """`0.2 * ROUGE-1 + 0.4 * ROUGE-2 + 0.4 * ROUGE-L` (F scores), the CAIL2020 summarisation score."""
    return 0.2 * scores["rouge-1"] + 0.4 * scores["rouge-2"] + 0.4 * scores["rouge-l"]


def oracle_labels(sentences: list[str], summary: str, max_sentences: int | None = None) -> list[int]:
    """Greedy oracle: extraction labels whose sentences, in document order, best match `summary`.

    Starting from nothing, repeatedly add the sentence that most raises `0.2 ROUGE-1 + 0.4 ROUGE-2`
    (F, characters, the `rouge` package) of the selection against the summary; stop when no
    sentence raises it (or at `max_sentences`). This is the usual greedy oracle of extractive
    summarisation (Nallapati et al., 2017) with the n-gram part of the CAIL score; ROUGE-L is left
    out of the search because its LCS makes each step quadratic in the document length.

    The scores are the `rouge` package's (sets of character n-grams), computed from each sentence's own
    n-grams and the bigrams across the selection's sentence boundaries, so a step costs about the
    selection's size per candidate instead of re-reading the selection's text; texts with a "." (where the
    package splits sentences) are scored by the package itself.
    """
    if "." in summary or any("." in sentence for sentence in sentences):
        def score(selection):
            scores = rouge_scores("".join(sentences[i] for i in selection), summary, metrics=("rouge-1", "rouge-2"))
            return cail_score({**scores, "rouge-l": 0.0})
    else:
        score = _ngram_scorer(sentences, summary)
    chosen: list[int] = []
    best = 0.0
    while max_sentences is None or len(chosen) < max_sentences:
        candidates = [(score(sorted([*chosen, index])), index) for index in range(len(sentences)) if index not in chosen]
        if not candidates:
            break
        value, index = max(candidates)
        if value <= best:
            break
        best = value
        chosen.append(index)
    return [int(i in chosen) for i in range(len(sentences))]


def _ngram_scorer(sentences: list[str], summary: str):
    """`0.2 ROUGE-1 + 0.4 ROUGE-2` F over characters of the sentences `selection` (in order) against `summary`,
    from per-sentence character and bigram sets: what the `rouge` package computes for text without "."."""
    characters = [[c for c in sentence if not c.isspace()] for sentence in sentences]
    unigrams = [set(chars) for chars in characters]
    bigrams = [set(zip(chars, chars[1:])) for chars in characters]
    reference = [c for c in summary if not c.isspace()]
    reference_unigrams, reference_bigrams = set(reference), set(zip(reference, reference[1:]))

    def score(selection):
        present = [i for i in selection if characters[i]]
        if not present or not reference:
            return 0.0
        seen = set().union(*(unigrams[i] for i in present))
        pairs = set().union(*(bigrams[i] for i in present))
        pairs.update((characters[a][-1], characters[b][0]) for a, b in zip(present, present[1:]))
        return cail_score({"rouge-1": f_score(len(seen & reference_unigrams), len(seen), len(reference_unigrams)),
                           "rouge-2": f_score(len(pairs & reference_bigrams), len(pairs), len(reference_bigrams)),
                           "rouge-l": 0.0})

    return score


def lead(sentences: list[str], count: int = 3) -> str:
    """The lead-N baseline: the first `count` sentences."""
    return "".join(sentences[:count])


__all__ = ["Judgment", "cail_score", "input_files", "lead", "oracle_labels", "read_command_inputs", "read_judgments",
           "read_predictions", "rouge_l", "rouge_scores", "split_sentences"]
