"""Plausible one-line bugs the test suite must catch, each with the tests that should catch it.

Every entry replaces `original` (which must occur exactly once in `file`) by `mutant` in a temporary
copy of the repository and runs `tests` there; the bug is caught when at least one test fails.
Add an entry whenever a bug slips past the tests: first the entry (it survives), then the test.
"""

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Mutation:
    name: str
    file: str
    original: str
    mutant: str
    tests: list[str] = field(default_factory=list)


ATTENTION_TESTS = ["tests/test_relative_attention.py", "tests/test_modeling_nezha.py", "-m", "not slow"]
KERNEL_TESTS = ["tests/test_fused_attention.py", "-m", "not slow"]
CHUNKED_TESTS = ["tests/test_chunked_attention.py", "-m", "not slow"]
SAFE_OUTPUT_TESTS = ["tests/test_safe_output.py", "tests/test_nothing_lost.py", "tests/test_conversion.py", "tests/test_hub.py",
                     "-m", "not slow"]
UNILM_TESTS = ["tests/test_modeling_nezha_unilm.py", "tests/test_generation_nezha.py", "tests/test_unilm.py", "-m", "not slow"]
CONVERSION_TESTS = ["tests/test_conversion.py", "-m", "not slow"]
CAIL_TESTS = ["tests/test_cail.py"]
RESUME_TESTS = ["tests/test_pretraining.py", "-k", "resume"]

MUTATIONS = [
    # --- relative positions (one place each: attention_ops.py, relative_attention.py) ---
    Mutation("relative index clipped at -K + 1 instead of -K", "nezha_hf/attention_ops.py",
             "query_position[:, None]).clamp(-K, K) + K\n", "query_position[:, None]).clamp(-K + 1, K) + K\n",
             ATTENTION_TESTS),
    Mutation("relative index not shifted by K", "nezha_hf/attention_ops.py",
             "query_position[:, None]).clamp(-K, K) + K\n", "query_position[:, None]).clamp(-K, K) + K - 1\n",
             ATTENTION_TESTS),
    Mutation("sin and cos columns of the table swapped", "nezha_hf/attention_ops.py",
             "table[:, 0::2] = torch.sin(position * div_term)", "table[:, 0::2] = torch.cos(position * div_term)",
             ATTENTION_TESTS),
    Mutation("cached queries start at position 0", "nezha_hf/attention_ops.py",
             "return torch.arange(start, query_length, device=device) + query_offset",
             "return torch.arange(start, query_length, device=device)",
             ["tests/test_modeling_nezha.py", "-m", "not slow", "-k", "cache or cached"]),
    # --- the chunked path: tail constants and boundaries ---
    Mutation("chunked left tail's key term takes table row 1, not row 0", "nezha_hf/chunked_attention.py",
             "extra = [per_row[..., [0, -1]], ", "extra = [per_row[..., [1, -1]], ", CHUNKED_TESTS),
    Mutation("chunked right tail's key term takes table row 2K - 1, not 2K", "nezha_hf/chunked_attention.py",
             "extra = [per_row[..., [0, -1]], ", "extra = [per_row[..., [0, -2]], ", CHUNKED_TESTS),
    Mutation("chunked left tail's value term takes table row 1, not row 0", "nezha_hf/chunked_attention.py",
             "bucket[..., 0] += weights[..., : chunk.left_end].sum(-1)",
             "bucket[..., 1] += weights[..., : chunk.left_end].sum(-1)", CHUNKED_TESTS),
    Mutation("chunked right tail's mass misses its first key", "nezha_hf/chunked_attention.py",
             "bucket[..., -1] += weights[..., chunk.right_start :].sum(-1)",
             "bucket[..., -1] += weights[..., chunk.right_start + 1 :].sum(-1)", CHUNKED_TESTS),
    Mutation("chunked left tail takes one key of the band", "nezha_hf/chunked_attention.py",
             "self.left_end = min(max(self.first - K + 1, 0), self.keys)",
             "self.left_end = min(max(self.first - K + 2, 0), self.keys)", CHUNKED_TESTS),
    Mutation("chunked left-tail column misses the last key that joins it", "nezha_hf/chunked_attention.py",
             "tensor[..., self.left_end : chunk.left_end, LEFT_TAIL] = 1",
             "tensor[..., self.left_end : chunk.left_end - 1, LEFT_TAIL] = 1", CHUNKED_TESTS),
    Mutation("chunked path lets a row that sees no key keep the softmax's NaN", "nezha_hf/chunked_attention.py",
             "            probs.masked_fill_(nothing[:, None, :, None], 0.0)\n", "            pass\n",
             ATTENTION_TESTS),
    Mutation("kernel zeroes a NaN row (a maximum that skips NaN)", "nezha_hf/csrc/fused_attention.cpp",
             "if (new_max == kNegInf && std::any_of(row, row + kb, [](float x) { return x != x; }))",
             "if (false && std::any_of(row, row + kb, [](float x) { return x != x; }))", ATTENTION_TESTS),
    # --- the shared rules (attention_ops.py): which keys a query sees, what a row that sees nothing gives ---
    Mutation("rule: under a causal mask each query sees the next key", "nezha_hf/attention_ops.py",
             "allowed = (keys <= queries)[None]", "allowed = (keys <= queries + 1)[None]", ATTENTION_TESTS),
    Mutation("rule: the UniLM prefix mask ignores the source keys", "nezha_hf/attention_ops.py",
             "allowed = allowed | mask.key_is_source[:, keys]", "allowed = allowed", ATTENTION_TESTS),
    Mutation("rule: padding is seen", "nezha_hf/attention_ops.py",
             "allowed = valid if allowed is None else allowed & valid", "allowed = allowed", ATTENTION_TESTS),
    Mutation("rule: no row sees nothing", "nezha_hf/attention_ops.py",
             "    if mask.key_is_valid is None:\n        return None\n    keys = mask.key_is_valid.shape[1]",
             "    return None\n    keys = mask.key_is_valid.shape[1]", ATTENTION_TESTS),
    Mutation("rule: under a causal mask a row before its first valid key still sees a later one",
             "nezha_hf/attention_ops.py", "nothing = first_valid[:, None] > query_position[None, :]",
             "nothing = first_valid[:, None] > query_position[None, :] + 1", ATTENTION_TESTS),
    Mutation("chunked engine computes float64 in float32", "nezha_hf/chunked_attention.py",
             "self.dtype = torch.promote_types(query.dtype, torch.float32)", "self.dtype = torch.float32",
             ATTENTION_TESTS),
    Mutation("chunked backward without dropout does not subtract D = dO . O", "nezha_hf/chunked_attention.py",
             "constant = None if dropout > 0 else -row_dot", "constant = None", CHUNKED_TESTS),
    Mutation("chunked value term's bucket sums over the wrong rows", "nezha_hf/chunked_attention.py",
             "bucket.scatter_add_(-1, chunk.middle_index(weights.device).expand(*middle.shape), middle)",
             "bucket.scatter_add_(-1, (2 * chunk.K - chunk.middle_index(weights.device)).expand(*middle.shape), middle)",
             CHUNKED_TESTS),
    Mutation("chunked causal mask reaches past the chunk's last query", "nezha_hf/chunked_attention.py",
             "return min(self.key_length, max(last + 1, self.source_end)) if self.causal else self.key_length",
             "return min(self.key_length, max(last, self.source_end)) if self.causal else self.key_length",
             CHUNKED_TESTS),
    # --- three regions ---
    Mutation("three regions: right tail at table row 2K - 1", "nezha_hf/three_regions.py",
             'self.row = 0 if side == "left" else 2 * K', 'self.row = 0 if side == "left" else 2 * K - 1',
             ["tests/test_three_regions.py", "-m", "not slow"]),
    # --- the compiled kernel: band rows, tails, bucket sums ---
    Mutation("kernel band reads the table one row early", "nezha_hf/csrc/fused_attention.cpp",
             "body(left, right, n - i + K, std::integral_constant<int64_t, 1>());",
             "body(left, right, n - i + K - 1, std::integral_constant<int64_t, 1>());", KERNEL_TESTS),
    Mutation("kernel left tail takes one key of the band", "nezha_hf/csrc/fused_attention.cpp",
             "const int64_t left = std::min(std::max(i - K + 1 - n, int64_t(0)), kb);",
             "const int64_t left = std::min(std::max(i - K + 2 - n, int64_t(0)), kb);", KERNEL_TESTS),
    Mutation("kernel forward forgets to rescale the bucket sums when the row maximum grows",
             "nezha_hf/csrc/fused_attention.cpp",
             "for (int64_t x = 0; x < R; ++x) row_bucket[x] *= correction;",
             "for (int64_t x = 0; x < R; ++x) row_bucket[x] *= 1.0f;", KERNEL_TESTS),
    Mutation("kernel backward drops the tails' bucket sums", "nezha_hf/csrc/fused_attention.cpp",
             "                if constexpr (!step) row_bucket[first] += range_sum;\n                return;",
             "                return;", KERNEL_TESTS),
    Mutation("kernel dropout leaves the dropped probabilities in the softmax denominator out",
             "nezha_hf/csrc/fused_attention.cpp",
             "              range_sum += e;\n              row[c] = e * p.keep_factor(key, n + c);",
             "              row[c] = e * p.keep_factor(key, n + c);\n              range_sum += row[c];", KERNEL_TESTS),
    # --- the kernel's reduced-precision products ---
    Mutation("kernel multiplies reduced precision in float32 where the CPU has AMX", "nezha_hf/csrc/fused_attention.cpp",
             "return is_reduced(type) && cpublas::could_pack(type) ? kReducedPacked : kFloat32;",
             "return kFloat32;", KERNEL_TESTS),
    Mutation("kernel's packed value product reads probabilities past the keys a row sees",
             "nezha_hf/csrc/fused_attention.cpp",
             "            std::fill(kept + kb, kept + even(value_keys), T(0));\n",
             "", KERNEL_TESTS),
    Mutation("kernel's packed key block panels start one panel late", "nezha_hf/csrc/fused_attention.cpp",
             "cpublas::brgemm(M, width, Ke, lda, width, ldc, accumulate, A, data + j * Ke, C + (j - first), true);",
             "cpublas::brgemm(M, width, Ke, lda, width, ldc, accumulate, A, data + (j + kPanel * (j > first)) * Ke, "
             "C + (j - first), true);", KERNEL_TESTS),
    Mutation("kernel rounds the value term's bucket masses without clearing their padding column",
             "nezha_hf/csrc/fused_attention.cpp",
             "        std::fill(rounded + r * width + R, rounded + (r + 1) * width, T(0));\n", "", KERNEL_TESTS),
    # --- the UniLM head and generation ---
    Mutation("UniLM head drops its token types", "nezha_hf/modeling_nezha.py",
             "            attention_mask=attention_mask,\n            token_type_ids=token_type_ids,",
             "            attention_mask=attention_mask,\n            token_type_ids=None,", UNILM_TESTS),
    Mutation("generation gives the first generated token the source type", "nezha_hf/generation_nezha.py",
             "torch.where(position >= source_length, torch.ones_like(types), types)",
             "torch.where(position > source_length, torch.ones_like(types), types)", UNILM_TESTS),
    Mutation("prefix mask ignores which keys are source", "nezha_hf/modeling_nezha.py",
             "            source_mask=source_mask,\n", "            source_mask=None,\n", UNILM_TESTS),
    Mutation("copy tags: a continuation only has to follow in the source", "nezha_hf/unilm.py",
             "tags[t] = 2 if (i, t) == (previous[0] + 1, previous[1] + 1) else 1",
             "tags[t] = 2 if i == previous[0] + 1 else 1", UNILM_TESTS),
    Mutation("copy decoding: a continued span restarts at length 1", "nezha_hf/generation_nezha.py",
             "span = tag if tag < 2 else span + 1", "span = tag if tag < 2 else 1", UNILM_TESTS),
    # --- converters ---
    Mutation("converter swaps query and key", "nezha_hf/conversion.py",
             'name = re.sub(r"^(bert|nezha)\\.", "", source_name)',
             'name = re.sub(r"^(bert|nezha)\\.", "", source_name).replace(".query.", ".QUERY.")'
             '.replace(".key.", ".query.").replace(".QUERY.", ".key.")',
             CONVERSION_TESTS),
    Mutation("TF kernels not transposed", "nezha_hf/conversion.py",
             "value = value.T.contiguous()", "value = value.contiguous()",
             CONVERSION_TESTS),
    Mutation("LayerNorm gamma renamed to bias", "nezha_hf/conversion.py",
             'name = re.sub(r"LayerNorm\\.gamma$", "LayerNorm.weight", name)',
             'name = re.sub(r"LayerNorm\\.gamma$", "LayerNorm.bias", name)',
             CONVERSION_TESTS),
    # --- the CAIL score ---
    Mutation("ROUGE F1 (ROUGE-L and the oracle's n-grams) replaced by recall", "nezha_hf/cail.py",
             "return 2.0 * ((precision * recall) / (precision + recall + 1e-8))", "return recall",
             CAIL_TESTS),
    Mutation("ROUGE-1/2 recall instead of F", "nezha_hf/cail.py",
             'result[name]["f"] if name != "rouge-l"', 'result[name]["r"] if name != "rouge-l"',
             CAIL_TESTS),
    Mutation("CAIL weights of ROUGE-1 and ROUGE-2 swapped", "nezha_hf/cail.py",
             'return 0.2 * scores["rouge-1"] + 0.4 * scores["rouge-2"]',
             'return 0.4 * scores["rouge-1"] + 0.2 * scores["rouge-2"]', CAIL_TESTS),
    # --- resuming training ---
    Mutation("pretraining ignores its checkpoint", "nezha_hf/pretraining.py",
             "metrics = trainer.train(resume_from_checkpoint=str(last) if last else None).metrics",
             "metrics = trainer.train(resume_from_checkpoint=None).metrics",
             RESUME_TESTS),
    Mutation("resume takes an incomplete checkpoint", "nezha_hf/checkpoints.py",
             "        problem = checkpoint_problem(folder)\n", "        problem = None\n",
             RESUME_TESTS),
    Mutation("masks drawn from the global random state (not reproducible on resume)", "nezha_hf/pretraining.py",
             'manual_seed((self.seed * 1_000_003 + self.epoch) * 1_000_003 + int(feature["index"]))',
             "manual_seed(int(torch.randint(1 << 62, ())))",
             RESUME_TESTS),
    # --- safe outputs ---
    Mutation("a destination inside its source is allowed", "nezha_hf/safe_output.py",
             "if resolved == source or source in resolved.parents or resolved in source.parents:",
             "if resolved == source:", SAFE_OUTPUT_TESTS),
    Mutation("a failed write leaves its half-written folder", "nezha_hf/safe_output.py",
             "            _remove(staging)  # nothing left after", "            pass  # nothing left after", SAFE_OUTPUT_TESTS),
    Mutation("a new save leaves the old model's weight shards", "nezha_hf/safe_output.py",
             "not (drops_weights and SAVED_WEIGHTS.fullmatch(old.name))", "True", SAFE_OUTPUT_TESTS),
    Mutation("a destination that appeared during the run is replaced", "nezha_hf/safe_output.py",
             "    if _occupied(destination) and not overwrite:\n        raise FileExistsError(\n            f\"{destination} appeared",
             "    if False:\n        raise FileExistsError(\n            f\"{destination} appeared", SAFE_OUTPUT_TESTS),
    Mutation("a resume of another run is taken", "nezha_hf/checkpoints.py",
             "        if resume and difference:", "        if False:", ["tests/test_nothing_lost.py", "-k", "another_run"]),
    Mutation("2-D masks are not checked for 0/1", "nezha_hf/modeling_nezha.py",
             "    if mask.dtype != torch.bool and values_known(mask)", "    if False and values_known(mask)",
             ["tests/test_modeling_nezha.py", "-k", "bad_input"]),
    # --- several processes ---
    Mutation("FSDP2 shards the model before its tied weights are tied", "nezha_hf/modeling_nezha.py",
             "            if distributed_config.dp_size > 1:\n                model.tie_weights(recompute_mapping=False)\n",
             "", ["tests/test_distributed.py", "-k", "fsdp_makes"]),
    Mutation("a resumed sharded run starts with a fresh optimizer", "nezha_hf/distributed.py",
             "            load_optimizer_distributed(self.model, self.optimizer, os.path.join(checkpoint, OPTIMIZER_DCP))\n",
             "            pass\n", ["tests/test_distributed.py", "-k", "killed"]),
    Mutation("a rerun of summarize does again what the killed run wrote", "nezha_hf/distributed.py",
             "        done = _read_journal(journal)\n", "        done = {}\n",
             ["tests/test_distributed.py", "-k", "summarize"]),
    # --- export ---
    Mutation("exporting a model object switches the caller's model to the L x L gather path", "nezha_hf/export.py",
             "_from_config(copy.deepcopy(model_or_path.config), ", "_from_config(model_or_path.config, ",
             ["tests/test_export.py", "-m", "not slow"]),
]
