"""Input files are read as files (issue 46, findings 4 to 6): one decision per file about its encoding, a file that
cannot be read refused whole, input kinds by suffix whatever its case, hidden files and links out of a folder left
alone, empty judgments refused, and prediction ids that are duplicated, foreign or malformed refused.

Each reader is tried over a range of inputs (encodings, suffix cases, blank variants), not the one value found:
`read_judgments` (summarize, train-summarizer, evaluate) and `read_documents` (pretrain) alike."""

import codecs
import json
import os
import random
import re
import subprocess
import sys
import threading

import pytest
from helpers import synthetic_judgment, write_jsonl
from test_cli import one_line_failure
from test_nothing_lost import base_model
from test_reuse_and_damage import summarizer_folder

from nezha_hf.cail import read_judgments
from nezha_hf.documents import read_documents
from nezha_hf.summarization import evaluate_summaries

CLI = [sys.executable, "-m", "nezha_hf"]

# A judgment with ASCII digits and line breaks (NUL bytes in UTF-16) and 一 (U+4E00: a NUL byte in UTF-16 too, on the
# other side), and its sentences written out by hand.
JUDGMENT = ("原告张某诉被告李某借款合同纠纷一案，本院于2019年3月1日立案。\n"
            "第一审判决如下：被告于判决生效之日起十日内偿还原告借款10000元。\n")
SENTENCES = ["原告张某诉被告李某借款合同纠纷一案，本院于2019年3月1日立案。",
             "第一审判决如下：被告于判决生效之日起十日内偿还原告借款10000元。"]


def encoded(text: str, encoding: str) -> bytes:
    """`text` in `encoding`, a codec's name; `NAME+bom` puts the byte-order mark first."""
    name, _, bom = encoding.partition("+")
    marks = {"utf-8": codecs.BOM_UTF8, "utf-16-le": codecs.BOM_UTF16_LE, "utf-16-be": codecs.BOM_UTF16_BE,
             "utf-32-le": codecs.BOM_UTF32_LE, "utf-32-be": codecs.BOM_UTF32_BE}
    return (marks[name] if bom == "bom" else b"") + text.encode(name)


# (how the file is written, the --encoding given): each is read as the text it holds.
READABLE = [
    ("utf-8", None),
    ("utf-8+bom", None),
    ("utf-16-le+bom", None),
    ("utf-16-be+bom", None),
    ("utf-16-le", None),  # no byte-order mark: told by where its NUL bytes are
    ("utf-16-be", None),
    ("utf-32-le+bom", None),
    ("utf-32-be+bom", None),
    ("gb18030", "gb18030"),
    ("gbk", "gb18030"),  # GB18030 reads GBK (and GB2312)
    ("utf-8", "gb18030"),  # UTF-8 stays UTF-8 whatever --encoding says: never read as GB18030
    ("utf-16-le+bom", "gb18030"),  # a byte-order mark says what the file is
    ("utf-16-le", "gb18030"),  # and so do NUL bytes
]


def bad_byte_in_the_middle(text: str) -> bytes:
    """UTF-8 with one byte that is not, between two characters two thirds of the way in."""
    data = text.encode("utf-8")
    middle = len(data) * 2 // 3
    while data[middle] & 0xC0 == 0x80:  # a continuation byte: not between two characters yet
        middle += 1
    return data[:middle] + b"\xff" + data[middle:]


# (bytes, --encoding, words the one line naming the refused file must hold)
UNREADABLE = {
    "gb18030": (lambda text: text.encode("gb18030"), None, ["not UTF-8", "--encoding gb18030"]),
    "gbk": (lambda text: text.encode("gbk"), None, ["not UTF-8", "--encoding gb18030"]),
    "latin-1 bytes": (lambda text: text.encode("utf-8").replace("原告".encode(), "Café".encode("latin-1")), None,
                      ["not UTF-8"]),
    "one bad byte in the middle": (bad_byte_in_the_middle, None, ["not UTF-8", "line "]),
    "not GB18030 either": (lambda text: text.encode("utf-8")[:20] + b"\xff\xff" + text.encode("utf-8")[20:], "gb18030",
                           ["gb18030"]),
    "truncated UTF-16": (lambda text: encoded(text, "utf-16-le+bom")[:-1], None, ["UTF-16"]),
    "NUL bytes, not UTF-16": (lambda text: b"\x00\x00\x00" + text.encode("utf-8"), None, ["NUL"]),
    # Round four's review: UTF-8 with one stray NUL was read as UTF-16 mojibake at an even length.
    "UTF-8 with a stray NUL, even length": (lambda text: _even(text.encode("utf-8") + b"\x00"), None, ["NUL", "UTF-8"]),
    "UTF-8 with a stray NUL, odd length": (lambda text: _even(text.encode("utf-8") + b"\x00") + b"\n", None,
                                           ["NUL", "UTF-8"]),
}


def _even(data: bytes) -> bytes:
    """`data`, one space longer where its length is odd."""
    return data if len(data) % 2 == 0 else data.replace(b"\x00", b" \x00", 1)


def write(path, data: bytes):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return path


def jsonl_record(text: str) -> str:
    return json.dumps({"id": "j", "text": text}, ensure_ascii=False) + "\n"


# --- encodings: one decision per file ------------------------------------------------------------------------------


@pytest.mark.parametrize("encoding, given", READABLE, ids=lambda v: str(v))
def test_every_reader_reads_each_encoding_as_the_text_it_holds(tmp_path, encoding, given):
    """A UTF-16 judgment was summarised (and pretrained on) as mojibake, with exit 0."""
    txt = write(tmp_path / "judgments" / "j.txt", encoded(JUDGMENT, encoding))
    jsonl = write(tmp_path / "data" / "j.jsonl", encoded(jsonl_record(JUDGMENT), encoding))
    for paths in ([txt], [txt.parent], [jsonl], [jsonl.parent]):
        problems = []
        judgments = read_judgments(paths, problems, encoding=given)
        assert problems == [] and [j.sentences for j in judgments] == [SENTENCES], (paths, problems)
    for split, expected in (("file", [JUDGMENT.strip()]), ("lines", SENTENCES), ("blank-lines", [JUDGMENT.strip()])):
        problems = []
        documents = read_documents([txt.parent], txt_split=split, problems=problems, encoding=given)
        assert problems == [] and [d.text for d in documents] == expected, (split, problems)
    problems = []
    documents = read_documents([jsonl], problems=problems, encoding=given)
    assert problems == [] and [d.text for d in documents] == [JUDGMENT]


def test_utf8_that_is_also_gb18030_is_read_as_utf8(tmp_path):
    """--encoding names the encoding of files that are not UTF-8; it never turns UTF-8 into GB18030 mojibake."""
    text = "判决如下驳回原告诉讼请求"
    assert text.encode("utf-8").decode("gb18030") != text  # the bytes are GB18030 too, of other characters
    path = write(tmp_path / "j.txt", text.encode("utf-8"))
    assert [j.text for j in read_judgments([path], encoding="gb18030")] == [text]
    assert [d.text for d in read_documents([path], encoding="gb18030")] == [text]


def check_refused(problems, path, words):
    """`problems` is one, naming the file `path` (no line) and saying why in `words`."""
    assert [(p.path, p.line) for p in problems] == [(str(path), None)], problems
    assert all(word in problems[0].message for word in words), problems[0]


@pytest.mark.parametrize("kind", UNREADABLE)
def test_a_file_that_cannot_be_decoded_is_refused_whole(tmp_path, kind):
    """One non-UTF-8 line was dropped and the rest summarised as if whole; a GB18030 file gave one stderr line per
    line with no word about its encoding, and inside a folder the judgment vanished with exit 0."""
    make, given, words = UNREADABLE[kind]
    good = write(tmp_path / "judgments" / "a.txt", JUDGMENT.encode("utf-8"))
    for name, data in (("b.txt", make(JUDGMENT)), ("b.jsonl", make(jsonl_record(JUDGMENT)))):
        bad = write(tmp_path / "judgments" / name, data)
        # Found in a folder: left out whole, in one problem naming the file (no line); the others are read.
        problems = []
        assert [j.sentences for j in read_judgments([good.parent], problems, encoding=given)] == [SENTENCES]
        check_refused(problems, bad, words)
        problems = []
        assert [d.text for d in read_documents([good.parent], "lines", problems, encoding=given)] == SENTENCES
        check_refused(problems, bad, words)
        # Named directly: an error naming it.
        for read in (lambda: read_judgments([good, bad], encoding=given),
                     lambda: list(read_documents([good, bad], encoding=given))):
            with pytest.raises(ValueError, match=re.escape(str(bad))) as error:
                read()
            assert all(word in str(error.value) for word in words), error.value
        bad.unlink()


def test_pure_cjk_utf16_without_a_byte_order_mark_is_refused_not_guessed(tmp_path):
    """UTF-16 with no ASCII has no NUL byte to tell it by: it is refused as not UTF-8, never read as something else."""
    data = "原告胜诉。被告败诉。".encode("utf-16-le")
    assert b"\x00" not in data
    with pytest.raises(UnicodeDecodeError):
        data.decode("utf-8")
    with pytest.raises(ValueError, match="not UTF-8"):
        read_judgments([write(tmp_path / "j.txt", data)])


# --- which files a folder holds -----------------------------------------------------------------------------------


def test_input_kinds_are_told_by_their_suffix_whatever_its_case(tmp_path):
    folder = tmp_path / "judgments"
    write(folder / "A.TXT", "原告胜诉。".encode())
    write(folder / "b.Txt", "被告败诉。".encode())
    write(folder / "c.JsonL", jsonl_record("法院判决。").replace('"j"', '"c"').encode())
    write(folder / "d.JSON", jsonl_record("驳回起诉。").replace('"j"', '"d"').encode())
    write(folder / "notes.md", "not a judgment".encode())  # other kinds in a folder are not inputs
    assert [j.id for j in read_judgments([folder])] == ["A", "b", "c", "d"]
    assert [d.text for d in read_documents([folder])] == ["原告胜诉。", "被告败诉。", "法院判决。", "驳回起诉。"]
    for name in ("notes.md", "data.csv", "README", "judgment.txt.bak"):
        path = write(tmp_path / name, "原告胜诉。".encode())
        for read in (lambda: read_judgments([path]), lambda: list(read_documents([path]))):
            with pytest.raises(ValueError, match=rf"{re.escape(str(path))}.*\.txt, \.jsonl, \.json"):
                read()


def test_hidden_files_and_folders_are_not_inputs(tmp_path):
    folder = tmp_path / "judgments"
    write(folder / "a.txt", "原告胜诉。".encode())
    write(folder / "sub" / "b.txt", "被告败诉。".encode())
    write(folder / ".DS_Store", b"\x00\x00\x00\x01Bud1\x00")
    write(folder / "._a.txt", b"\x00\x05\x16\x07\x00\x02\x00\x00Mac OS X        ")  # macOS AppleDouble
    write(folder / ".hidden.txt", "隐藏。".encode())
    write(folder / ".a.txt.swp", b"b0VIM 8.2\x00\x00")
    write(folder / "a.txt~", "备份。".encode())
    write(folder / "#a.txt#", "自动保存。".encode())
    write(folder / ".git" / "notes.txt", "版本库。".encode())
    write(folder / "sub" / ".cache" / "x.jsonl", jsonl_record("缓存。").encode())
    problems = []
    assert [j.id for j in read_judgments([folder], problems)] == ["a", "sub/b"] and problems == []
    assert [d.text for d in read_documents([folder], problems=problems)] == ["原告胜诉。", "被告败诉。"]
    assert problems == []
    # Named directly, a hidden file is read: the user asked for it.
    assert [j.id for j in read_judgments([folder / ".hidden.txt"])] == [".hidden"]


@pytest.mark.skipif(os.name == "nt", reason="symbolic links need privileges on Windows")
@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="named pipes are a POSIX thing")
def test_a_pipe_in_a_folder_is_left_out_not_waited_on(tmp_path):
    """Round four's review: a FIFO named `b.txt` in a judgments folder made the reader wait for ever."""
    folder = tmp_path / "judgments"
    write(folder / "a.txt", JUDGMENT.encode("utf-8"))
    os.mkfifo(folder / "b.txt")
    problems, found = [], []
    reader = threading.Thread(target=lambda: found.extend(read_judgments([folder], problems)), daemon=True)
    reader.start()
    reader.join(timeout=60)
    if reader.is_alive():  # waiting on the pipe: give it a writer, so that the test ends, and fail
        with open(folder / "b.txt", "w"):
            pass
        pytest.fail("the reader opened the pipe and waited on it")
    assert [j.id for j in found] == ["a"]
    check_refused(problems, folder / "b.txt", ["not a regular file"])


def test_links_out_of_a_folder_are_named_not_followed(tmp_path):
    """A folder from elsewhere holding `notes.txt -> ~/.netrc` would have put that file's text into the summaries
    (or a model's weights)."""
    elsewhere = tmp_path / "elsewhere"
    secret = write(elsewhere / "secret.txt", "私密。".encode())
    folder = tmp_path / "judgments"
    write(folder / "a.txt", "原告胜诉。".encode())
    write(folder / "sub" / "b.txt", "被告败诉。".encode())
    (folder / "out.txt").symlink_to(secret)
    (folder / "linked").symlink_to(elsewhere, target_is_directory=True)
    (folder / "alias.txt").symlink_to(folder / "a.txt")  # inside: read where it lies, once
    (folder / "again").symlink_to(folder / "sub", target_is_directory=True)
    (folder / "broken.txt").symlink_to(folder / "nowhere.txt")
    for read in (lambda problems: [j.id for j in read_judgments([folder], problems)],
                 lambda problems: [d.id for d in read_documents([folder], problems=problems)]):
        problems = []
        assert read(problems) in (["a", "sub/b"], [str(folder / "a.txt"), str(folder / "sub" / "b.txt")])
        named = {p.path: p.message for p in problems}
        assert sorted(named) == sorted(str(folder / name) for name in ("broken.txt", "linked", "out.txt")), problems
        assert str(secret) in named[str(folder / "out.txt")] and "link" in named[str(folder / "out.txt")]
        assert all(p.line is None for p in problems)
    # Named directly, a link is followed: the user named it.
    assert [j.text for j in read_judgments([folder / "out.txt"])] == ["私密。"]


# --- empty judgments --------------------------------------------------------------------------------------------

BLANKS = ["", " ", "\u3000", "\u3000\u3000 ", "\n", "\n\n\r\n", "\t \u3000\n"]


def test_a_record_whose_sentences_are_all_blank_is_a_problem_line(tmp_path):
    """A CAIL record whose sentences were all empty was summarised from nothing."""
    rng = random.Random(0)
    records = [synthetic_judgment(rng, 0)]
    for index in range(len(BLANKS)):
        sentences = [BLANKS[index], BLANKS[(index + 3) % len(BLANKS)]][: 1 + index % 2]
        records.append({"id": f"blank{index}", "summary": "原告胜诉。",
                        "text": [{"sentence": s, "label": 0} for s in sentences]})
    records += [{"id": f"blank-text{index}", "text": blank} for index, blank in enumerate(BLANKS)]
    path = write_jsonl(tmp_path / "data.jsonl", records)
    problems = []
    assert [j.id for j in read_judgments([path], problems)] == ["doc0"]
    assert [p.line for p in problems] == list(range(2, len(records) + 1))
    assert all(p.path == str(path) for p in problems)


@pytest.mark.parametrize("blank", BLANKS, ids=repr)
@pytest.mark.parametrize("encoding", ["utf-8", "utf-8+bom", "utf-16-le+bom"])
@pytest.mark.parametrize("suffix", [".txt", ".jsonl"])
def test_an_empty_or_blank_file_is_refused(tmp_path, blank, encoding, suffix):
    """An empty .txt judgment vanished without a word (and an empty JSONL file along with it)."""
    good = write(tmp_path / "judgments" / "a.txt", "原告胜诉。".encode())
    empty = write(tmp_path / "judgments" / f"b{suffix}", encoded(blank, encoding))
    for read in (lambda problems: [j.id for j in read_judgments([good.parent], problems)],
                 lambda problems: [d.text for d in read_documents([good.parent], problems=problems)]):
        problems = []
        assert read(problems) in (["a"], ["原告胜诉。"])
        assert [(p.path, p.line) for p in problems] == [(str(empty), None)] and "no text" in problems[0].message
    for read in (lambda: read_judgments([empty]), lambda: list(read_documents([empty]))):
        with pytest.raises(ValueError, match=f"{re.escape(str(empty))}.*no text"):
            read()


def test_a_json_line_that_gives_a_key_twice_is_a_problem_line(tmp_path):
    """`json.loads` keeps the last of two values of one key: `{"id": "a", ..., "id": "b"}` would be judgment b."""
    good = json.dumps({"id": "a", "text": "原告胜诉。"}, ensure_ascii=False)
    twice = ['{"id": "a", "text": "原告胜诉。", "id": "b"}', '{"id": "c", "text": "被告败诉。", "text": "法院判决。"}',
             '{"id": "d", "text": [{"sentence": "原告胜诉。", "label": 1, "label": 0}]}']
    path = write_jsonl(tmp_path / "data.jsonl", [], extra_lines=[good, *twice])
    for read in (lambda problems: [j.id for j in read_judgments([path], problems)],
                 lambda problems: [d.id for d in read_documents([path], problems=problems)]):
        problems = []
        assert read(problems) == ["a"]
        assert [p.line for p in problems] == [2, 3, 4] and all("twice" in p.message for p in problems), problems
    from nezha_hf.cail import read_predictions

    predictions = write_jsonl(tmp_path / "p.jsonl", [], extra_lines=['{"id": "a", "summary": "甲", "summary": "乙"}'])
    with pytest.raises(ValueError, match=r"p\.jsonl:1: .*twice"):
        read_predictions(predictions)


# --- predictions: ids checked ------------------------------------------------------------------------------------


def test_predictions_with_a_duplicate_a_foreign_or_a_malformed_line_are_refused(tmp_path):
    """`evaluate` kept the last of duplicate ids (a perfect 1.0 became 0.667, exit 0), ignored ids the references
    lack, and dropped malformed prediction lines without a word."""
    from nezha_hf.cail import read_predictions

    good = [{"id": "doc0", "summary": "原告胜诉。"}, {"id": "doc1", "summary": "被告败诉。"}]
    path = write_jsonl(tmp_path / "p.jsonl", good, extra_lines=[""])
    assert read_predictions(path) == {"doc0": "原告胜诉。", "doc1": "被告败诉。"}  # a blank line is no prediction
    duplicates = [
        [*good, {"id": "doc0", "summary": "别的。"}],
        # ids are matched as text: 1 and "1" are one id
        [{"id": 1, "summary": "原告胜诉。"}, {"id": "x", "summary": "甲"}, {"id": "1", "summary": "乙"}],
    ]
    for records in duplicates:
        with pytest.raises(ValueError, match=r"p\.jsonl:1 and .*p\.jsonl:3"):
            read_predictions(write_jsonl(path, records))
    malformed = ["{not json", "[1, 2]", json.dumps({"summary": "无编号。"}), json.dumps({"id": None, "summary": "空。"}),
                 json.dumps({"id": "doc2"}), json.dumps({"id": "doc2", "summary": None}),
                 json.dumps({"id": "doc2", "summary": 3}), json.dumps({"id": ["doc2"], "summary": "列表。"})]
    for line in malformed:
        with pytest.raises(ValueError, match=r"p\.jsonl:2\b") as error:
            read_predictions(write_jsonl(path, good[:1], extra_lines=[line]))
        assert "1 malformed line" in str(error.value), (line, error.value)
    with pytest.raises(ValueError, match=r"3 malformed lines.*p\.jsonl:2.*p\.jsonl:3.*p\.jsonl:4"):
        read_predictions(write_jsonl(path, good[:1], extra_lines=malformed[:1] * 2 + malformed[2:3]))
    for data, given in ((json.dumps(good[0], ensure_ascii=False).encode("gb18030"), None),
                        (b'{"id": "doc0", "summary": "\xff"}\n', None)):
        with pytest.raises(ValueError, match=rf"{re.escape(str(path))}: not UTF-8"):
            read_predictions(write(path, data), encoding=given)
    assert read_predictions(write(path, encoded(json.dumps(good[0], ensure_ascii=False), "utf-16-le+bom"))) == {
        "doc0": "原告胜诉。"}
    judgments = read_judgments([write_jsonl(tmp_path / "d.jsonl", [synthetic_judgment(random.Random(0), i)
                                                                   for i in range(2)])])
    for foreign in (["doc9"], ["doc9", "doc7", "doc8", "x", "y"]):
        predictions = {"doc0": "原告胜诉。", "doc1": "被告败诉。", **dict.fromkeys(foreign, "别的。")}
        with pytest.raises(ValueError, match=rf"{len(foreign)} prediction.*'{foreign[0]}'"):
            evaluate_summaries(judgments, predictions)


def test_evaluate_refuses_duplicate_prediction_ids_in_one_line(tmp_path, run_cli):
    """The finding as it was met: perfect predictions, then the same id again with a worse summary."""
    records = [synthetic_judgment(random.Random(2), i) for i in range(2)]
    data = write_jsonl(tmp_path / "data.jsonl", records)
    perfect = [{"id": r["id"], "summary": r["summary"]} for r in records]
    predictions = write_jsonl(tmp_path / "p.jsonl", [*perfect, {"id": "doc0", "summary": records[0]["summary"][:5]}])
    done = subprocess.run([*CLI, "evaluate", str(data), "--predictions", str(predictions)], capture_output=True,
                          text=True, timeout=300)
    one_line_failure(done, "p.jsonl:1", "p.jsonl:3", "doc0")
    foreign = write_jsonl(tmp_path / "f.jsonl", [*perfect, {"id": "doc5", "summary": "别的。"}])
    one_line_failure(run_cli("evaluate", data, "--predictions", foreign), "doc5")


# --- through the commands: one line, exit 2, before any work ---------------------------------------------------------


def fake_summarizer(tmp_path):
    """Enough of a summariser folder to pass the first check: the inputs are read before it is loaded."""
    folder = tmp_path / "summarizer"
    folder.mkdir()
    (folder / "summarizer.json").write_text("{}")
    return folder


def test_summarize_refuses_a_named_file_it_cannot_read_in_one_line(tmp_path, run_cli):
    model = fake_summarizer(tmp_path)
    good = write(tmp_path / "a.txt", JUDGMENT.encode("utf-8"))
    gb = write(tmp_path / "gb.txt", JUDGMENT.encode("gb18030"))
    done = subprocess.run([*CLI, "summarize", str(model), str(good), str(gb), "--output", str(tmp_path / "o.jsonl")],
                          capture_output=True, text=True, timeout=300)
    one_line_failure(done, str(gb), "not UTF-8", "--encoding gb18030")
    for path, words in ((write(tmp_path / "notes.md", JUDGMENT.encode("utf-8")), [".txt, .jsonl, .json"]),
                        (write(tmp_path / "blank.txt", "\u3000\n".encode()), ["no text"])):
        one_line_failure(run_cli("summarize", model, good, path, "--output", tmp_path / "o.jsonl"), str(path), *words)
    assert not (tmp_path / "o.jsonl").exists()


def test_a_folder_run_leaves_out_what_it_refuses_and_says_how_many(tmp_path, tokenizer, run_cli):
    model = summarizer_folder(tmp_path / "s", tokenizer)
    folder = tmp_path / "judgments"
    write(folder / "a.txt", JUDGMENT.encode("utf-8"))
    gb = write(folder / "b.txt", JUDGMENT.encode("gb18030"))
    write(folder / "c.TXT", encoded(JUDGMENT, "utf-16-le+bom"))
    write(folder / "._c.TXT", b"\x00\x05\x16\x07\x00\x02\x00\x00Mac OS X        ")
    output = tmp_path / "o.jsonl"
    done = run_cli("summarize", model, folder, "--output", output, "--extract-only")
    assert done.returncode == 0, done.stderr
    assert sum(str(gb) in line for line in done.stderr.splitlines()) == 1
    assert "--encoding gb18030" in done.stderr and "left out 1 input file" in done.stderr
    assert done.stderr.strip().splitlines()[-1].startswith("left out 1 input file"), done.stderr  # said at the end
    results = [json.loads(line) for line in output.read_text(encoding="utf-8").splitlines()]
    assert [r["id"] for r in results] == ["a", "c"]
    for result in results:  # the UTF-16 judgment's sentences, not mojibake
        assert result["summary"] == "".join(SENTENCES[i] for i in result["extracted"])
    done = run_cli("summarize", model, folder, "--output", output, "--extract-only", "--overwrite",
                   "--encoding", "gb18030")
    assert done.returncode == 0 and "left out" not in done.stderr, done.stderr
    results = [json.loads(line) for line in output.read_text(encoding="utf-8").splitlines()]
    assert [r["id"] for r in results] == ["a", "b", "c"]
    assert all(r["summary"] == "".join(SENTENCES[i] for i in r["extracted"]) for r in results)


def test_pretrain_train_summarizer_and_evaluate_refuse_a_named_file_they_cannot_read(tmp_path, tokenizer, run_cli):
    base = base_model(tmp_path / "base", tokenizer)
    gb_txt = write(tmp_path / "corpus.txt", JUDGMENT.encode("gb18030"))
    gb_jsonl = write(tmp_path / "data.jsonl",
                     (json.dumps(synthetic_judgment(random.Random(0), 0), ensure_ascii=False) + "\n").encode("gb18030"))
    for command in (["pretrain", base, gb_txt, "--output", tmp_path / "out", "--max-steps", "1"],
                    ["train-summarizer", gb_jsonl, "--base", base, "--output", tmp_path / "out"],
                    ["evaluate", gb_jsonl]):
        path = gb_txt if command[0] == "pretrain" else gb_jsonl
        one_line_failure(run_cli(*command), str(path), "not UTF-8", "--encoding gb18030")
    assert not (tmp_path / "out").exists() and not (tmp_path / "out.checkpoints").exists()
    done = run_cli("evaluate", gb_jsonl, "--encoding", "gb18030")
    assert done.returncode == 0 and "| oracle | char |" in done.stdout, done.stderr
    one_line_failure(run_cli("evaluate", gb_jsonl, "--encoding", "no-such-codec"), "--encoding", "no-such-codec")


# --- JSON inputs read as data (issue 54) ---------------------------------------------------------------------------


def test_a_pretty_printed_json_document_is_one_error_not_one_per_line(tmp_path, run_cli):
    """A `.json` file holding one indented JSON document gave one "not valid JSON" per line (471 for a real one)
    instead of saying that it is a JSON document, not JSON Lines."""
    records = [synthetic_judgment(random.Random(0), i) for i in range(3)]
    path = tmp_path / "judgments.json"
    path.write_text(json.dumps(records, ensure_ascii=False, indent=2), encoding="utf-8")
    with pytest.raises(ValueError, match="one JSON document spread over several lines, not JSON Lines"):
        read_judgments([path])
    folder = tmp_path / "folder"
    folder.mkdir()
    (folder / "judgments.json").write_text(json.dumps(records[0], ensure_ascii=False, indent=1), encoding="utf-8")
    write_jsonl(folder / "good.jsonl", records[1:])
    problems = []
    assert len(read_judgments([folder], problems)) == 2
    assert len(problems) == 1 and "not JSON Lines" in problems[0].message, problems
    one_line_failure(run_cli("evaluate", path), str(path), "not JSON Lines")


def test_a_deeply_nested_json_line_is_a_problem_line_not_a_crash(tmp_path):
    """10 KB of brackets on one line raised `RecursionError` from every reader of JSON Lines (inputs, predictions)."""
    good = json.dumps({"id": "a", "text": "原告胜诉。"}, ensure_ascii=False)
    path = write_jsonl(tmp_path / "data.jsonl", [], extra_lines=[good, "[" * 10_000 + "]" * 10_000])
    problems = []
    assert [d.id for d in read_documents([path], problems=problems)] == ["a"]
    assert [(p.line, "nests" in p.message) for p in problems] == [(2, True)], problems
    predictions = write_jsonl(tmp_path / "p.jsonl", [], extra_lines=['{"id": "a", "summary": "x"}', "{" * 5_000])
    from nezha_hf.cail import read_predictions

    with pytest.raises(ValueError, match=r"p\.jsonl:2: nests"):
        read_predictions(predictions)


def test_cail2020_records_with_text_as_a_list_of_sentences_are_pretraining_text(tmp_path, tokenizer, run_cli):
    """`pretrain` on a CAIL2020 file ("text" a list of {"sentence", "label"}) said "No text found" with no reason per
    line. Such a record is read as its sentences joined; a record with no usable text says why, per line."""
    judgment = synthetic_judgment(random.Random(0), 0)
    path = write_jsonl(tmp_path / "cail.jsonl", [judgment, {"id": "x", "text": [{"label": 1}]}, {"id": "y", "text": 3}])
    problems = []
    documents = read_documents([path], problems=problems)
    assert [d.text for d in documents] == ["".join(item["sentence"] for item in judgment["text"])]
    assert [p.line for p in problems] == [2, 3] and '"sentence"' in problems[0].message, problems
    assert "not a string" in problems[1].message
    base = base_model(tmp_path / "base", tokenizer)
    bad = write_jsonl(tmp_path / "bad.jsonl", [{"id": "y", "text": 3}, {"id": "z"}])
    one_line_failure(run_cli("pretrain", base, bad, "--output", tmp_path / "out"), "No text found",
                     "bad.jsonl:1", "not a string", "bad.jsonl:2", "missing")


def test_a_text_output_refuses_an_id_that_would_shift_its_lines(tmp_path, tokenizer, run_cli):
    """`summarize --output X.txt` wrote ids as they are: a file name holding a newline shifted every following line
    of the text output. Refused before any work; JSONL keeps such an id exactly."""
    model = summarizer_folder(tmp_path / "s", tokenizer)
    folder = tmp_path / "judgments"
    folder.mkdir()
    for name in ("a\nb.txt", "c.txt"):
        (folder / name).write_text("原告胜诉。被告败诉。", encoding="utf-8")
    output = tmp_path / "out.txt"
    one_line_failure(run_cli("summarize", model, folder, "--output", output, "--max-new-tokens", "4"),
                     str(output), "line break", ".jsonl")
    assert not output.exists()
    done = run_cli("summarize", model, folder, "--output", tmp_path / "out.jsonl", "--max-new-tokens", "4")
    assert done.returncode == 0, done.stderr
    assert [json.loads(line)["id"] for line in (tmp_path / "out.jsonl").read_text().splitlines()] == ["a\nb", "c"]
