"""Megatron-LM data through the launch script: weighted blends, start-up file checks, THD path.

Launches (torchrun, gloo, ~15-25 s each): a 0.3 / 0.7 blend of two indexed corpora built by the
documented command trains with dynamic batching through transformer-engine's THD path (packed rows
as ``PackedSeqParams``, attended by the reference THD attention, ``--transformer-impl local``) at
tp 2, and at tp 1 x pp 2; each equals Megatron's fixed micro-batches on the same samples within
1e-5 at every iteration and in validation, and the drawn token shares per split are within 3% of
the weights (Megatron's meaning of blend weights), printed once per split. A truncated ``.bin`` stops the entry before the model is built, in one line naming it.
"""

import json
import random
import re
import shutil

import pytest

from tests._support import BIN, LAUNCH, assert_same_training, parse_ok, torchrun, torchrun_chains

pytestmark = pytest.mark.torchrun

_TINY = [
    "--num-layers", 2, "--hidden-size", 32, "--num-attention-heads", 4,
    "--seq-length", 128, "--max-position-embeddings", 128,
    "--micro-batch-size", 2, "--global-batch-size", 8,
    "--lr", "2e-3", "--min-lr", "2e-4", "--lr-decay-style", "cosine", "--lr-warmup-iters", 1,
    "--tokenizer-type", "NullTokenizer", "--vocab-size", 257,
    "--log-interval", 1, "--calculate-per-token-loss", "--hidden-dropout", 0,
    "--attention-dropout", 0, "--seed", 7, "--split", "90,10,0",
    "--train-iters", 3, "--eval-interval", 3, "--eval-iters", 1,
]  # fmt: skip
_DYNAMIC_THD = [
    "--use-dynamic-batch-size", "--max-tokens-per-gpu", 256,
    "--dynamic-batch-attention", "reference",
]  # fmt: skip
_FIXED = ["--document-samples"]


def _corpora(out):
    """Two byte-token corpora (150 and 300 documents) built with the preprocessing command."""
    import subprocess

    rng = random.Random(3)
    words = "pipeline stage token budget rank loss gradient sample attention segment".split()
    prefixes = []
    # The code documents are longer (mean sample ~90 tokens against ~60): sample shares and
    # token shares of the blend differ, as on real corpora (issue 29).
    for name, count, mu in (("wiki", 150, 2.0), ("code", 300, 2.8)):
        source = out / f"{name}.jsonl"
        with open(source, "w") as handle:
            for _ in range(count):
                n = int(rng.lognormvariate(mu, 0.6)) + 1
                handle.write(json.dumps({"text": " ".join(rng.choice(words) for _ in range(n))}))
                handle.write("\n")
        subprocess.run(
            [str(BIN / "python"), "-m", "megatron_dynbatch.integrations.megatron_lm.data.preprocess",
             "--input", str(source), "--output-prefix", str(out / name), "--append-eod"],
            check=True, capture_output=True,
        )  # fmt: skip
        prefixes.append(str(out / f"{name}_text_document"))
    return prefixes


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("blend_thd")
    wiki, code = _corpora(out)
    blend = ["--data-path", "0.3", wiki, "0.7", code]
    layouts = {
        "tp2": ["--tensor-model-parallel-size", 2],
        "pp2": ["--pipeline-model-parallel-size", 2],
    }
    results = {"prefixes": (wiki, code), "out": out}
    chains = {
        (name, mode): [
            (2, LAUNCH, _TINY + blend + layout + flags, {"log_path": out / f"{name}-{mode}.log"})
        ]
        for name, layout in layouts.items()
        for mode, flags in (("dynamic", _DYNAMIC_THD), ("fixed", _FIXED))
    }
    for key, [(rc, log, _)] in torchrun_chains(chains).items():
        results[key] = parse_ok(rc, log)
        results[(*key, "log")] = log
    return results


@pytest.mark.parametrize("layout", ["tp2", "pp2"])
def test_the_thd_path_trains_like_fixed_micro_batches(runs, layout):
    assert_same_training(runs[layout, "dynamic"], runs[layout, "fixed"])
    log = runs[layout, "dynamic", "log"]
    # Packed rows reached the model as THD PackedSeqParams, several samples per row.
    found = re.search(r"> reference THD attention: a packed row of \d+ tokens, (\d+) segments", log)
    assert found and int(found.group(1)) >= 2, log[-3000:]
    assert "reference THD attention" not in runs[layout, "fixed", "log"]
    size = "tensor" if layout == "tp2" else "pipeline"
    assert f"{size}-model-parallel size: 2" in log


def test_a_weighted_blend_draws_the_weights_per_split_as_token_shares(runs):
    # The weights mean what they mean in Megatron (its samples are fixed windows): token shares.
    line = (
        r"> blend split (\d): weights \[0.3000, 0.7000\] are shares of the tokens \(--blend-weights "
        r"tokens, Megatron's meaning; [^)]*\): drawn token shares \[([^\]]+)\], sample shares "
        r"\[([^\]]+)\]"
    )
    for mode in ("dynamic", "fixed"):
        log = runs["tp2", mode, "log"]
        found = re.findall(line, log)
        # Printed once per split (rank 0 only, though the data is opened before torch.distributed).
        assert sorted(int(split) for split, _, _ in found) == [0, 1], log[-3000:]
        for _, tokens, samples in found:
            tokens = [float(x) for x in tokens.split(", ")]
            samples = [float(x) for x in samples.split(", ")]
            assert tokens == pytest.approx([0.3, 0.7], abs=0.03), (tokens, samples)
            # The short documents are drawn more often to make up their share of the tokens.
            assert samples[0] > 0.35, (tokens, samples)


def test_a_truncated_bin_stops_the_entry_before_the_model_is_built(runs, tmp_path):
    wiki, code = runs["prefixes"]
    broken = tmp_path / "wiki_text_document"
    shutil.copy(f"{wiki}.idx", f"{broken}.idx")
    data = open(f"{wiki}.bin", "rb").read()
    open(f"{broken}.bin", "wb").write(data[:-100])
    args = _TINY + ["--data-path", "0.3", broken, "0.7", code] + _FIXED
    rc, log, _ = torchrun(2, LAUNCH, args, log_path=tmp_path / "broken.log")
    assert rc != 0
    assert re.search(
        rf"pretrain_gpt_dynbatch.py: error: \[rank \d\] {re.escape(str(broken))}.bin: "
        rf"{len(data) - 100} bytes, "
        rf"but .* = {len(data)} bytes \(truncated",
        log,
    ), log[-3000:]
    # Refused at start-up (torchrun's own report of the failed child follows the line).
    assert "building GPT model" not in log and " iteration " not in log
