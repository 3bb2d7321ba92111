"""Document samples from Megatron's formats, and the byte-level .bin/.idx builder (in-process)."""

import json

import numpy
import pytest
import torch

from megatron_dynbatch.cpu.core_shim import apply_cpu_shim

apply_cpu_shim()  # importing megatron.core needs the triton stand-in on this machine

from megatron.core.datasets.indexed_dataset import IndexedDataset  # noqa: E402

from megatron_dynbatch.errors import DynBatchValueError  # noqa: E402
from megatron_dynbatch.integrations.megatron_lm.data import preprocess  # noqa: E402
from megatron_dynbatch.integrations.megatron_lm.data.documents import (  # noqa: E402
    DocumentBatchStream,
    DocumentCollection,
    DocumentSampleDataset,
    SplitSamples,
    indexed_documents,
    mock_documents,
    split_bookends,
    stream_starts,
)
from megatron_dynbatch.planning.fixed import plan_fixed_microbatches  # noqa: E402
from megatron_dynbatch.runtime import BatchSchema, materialize_microbatches  # noqa: E402

pytestmark = pytest.mark.unit


def _collection(lengths):
    lengths = numpy.asarray(lengths, dtype=numpy.int64)

    def read(document, offset, count):
        # Token t of document d is d * 1000 + t: every read is checkable.
        return numpy.arange(offset, offset + count, dtype=numpy.int64) + 1000 * document

    return DocumentCollection(lengths=lengths, read=read, name="test documents")


def test_split_bookends_follow_megatrons_rounding():
    assert split_bookends("98,2,0", 1000) == [(0, 980), (980, 1000), None]
    assert split_bookends("969, 30, 1", 2608) == [(0, 2527), (2527, 2605), (2605, 2608)]
    assert split_bookends("1,1,1", 10) == [(0, 3), (3, 7), (7, 10)]


def test_long_documents_become_consecutive_samples_and_no_token_is_lost():
    documents = _collection([5, 10, 23, 1, 11])
    samples = SplitSamples(documents, 1, 5, max_length=10, seed=3, split_index=0)
    assert len(samples) == 1 + 3 + 1 + 2  # documents 1..4 cut at 10 tokens
    tokens = [samples.sample_at(p)["tokens"].tolist() for p in range(len(samples))]
    assert all(1 <= len(t) <= 10 for t in tokens)
    assert sorted(sum(tokens, [])) == sorted(
        [1000 * d + t for d in range(1, 5) for t in range(int(documents.lengths[d]))]
    )
    assert samples.lengths_at(range(len(samples))) == [len(t) for t in tokens]


def test_order_is_seeded_per_split_and_reshuffled_every_epoch():
    documents = _collection([3] * 50)
    first = SplitSamples(documents, 0, 50, max_length=8, seed=1, split_index=0)
    again = SplitSamples(documents, 0, 50, max_length=8, seed=1, split_index=0)
    other_split = SplitSamples(documents, 0, 50, max_length=8, seed=1, split_index=1)
    epoch0 = [first.sample_at(p)["tokens"][0].item() for p in range(50)]
    assert epoch0 == [again.sample_at(p)["tokens"][0].item() for p in range(50)]
    assert epoch0 != [other_split.sample_at(p)["tokens"][0].item() for p in range(50)]
    epoch1 = [first.sample_at(p)["tokens"][0].item() for p in range(50, 100)]
    assert sorted(epoch0) == sorted(epoch1) and epoch0 != epoch1


def test_token_ids_outside_the_vocabulary_are_refused_naming_the_document():
    """Data made with another tokenizer: stock Megatron fails in the embedding of one rank
    (``IndexError``; on a GPU a device-side assert) while the others wait; the sample is refused
    when it is read, inside the step's agreement (a launch at --vocab-size 100 on byte data)."""
    documents = _collection([4, 30])  # document 1 holds 1000..1029
    fits = SplitSamples(documents, 0, 2, max_length=8, seed=0, split_index=0, vocab_size=1030)
    assert sum(len(fits.sample_at(p)["tokens"]) for p in range(len(fits))) == 34
    small = SplitSamples(documents, 0, 2, max_length=8, seed=0, split_index=0, vocab_size=1020)
    tokens = documents.read(1, 0, 30)
    refused = []
    for position in range(len(small)):
        try:
            small.sample_at(position)
        except DynBatchValueError as error:
            refused.append(str(error))
    # The samples holding 1020..1029 (document 1's tokens 20..29: two of its four 8-token pieces).
    assert len(refused) == 2 and all("document 1 holds token id 10" in m for m in refused)
    assert any("token id 1023 (at token 23)" in m for m in refused), refused
    assert all(
        "outside the model's vocabulary (1020 ids once padded" in m for m in refused
    ), refused
    assert int(tokens.max()) == 1029
    negative = DocumentCollection(
        lengths=numpy.array([3]), read=lambda d, o, c: numpy.array([5, -1, 2])[o : o + c], name="n"
    )
    with pytest.raises(DynBatchValueError, match="token id -1 .at token 1."):
        SplitSamples(negative, 0, 1, max_length=8, seed=0, split_index=0, vocab_size=9).sample_at(0)
    # NullTokenizer (ids 0..--vocab-size, its end of document the last): the value that fits.
    assert any("token id 1029" in m and "--vocab-size 1030 or more" in m for m in refused), refused
    # At start-up: the first samples of every split are read (the model not built yet).
    from megatron_dynbatch.integrations.megatron_lm.data.documents import check_first_samples

    check_first_samples([fits, None])
    with pytest.raises(DynBatchValueError, match="outside the model's vocabulary"):
        check_first_samples([fits, small])


def test_eod_mask_loss_drops_the_prediction_after_an_end_of_document_token():
    documents = _collection([6])  # tokens 0..5; call token 3 the end of a document
    samples = SplitSamples(documents, 0, 1, max_length=8, seed=0, split_index=0, eod_id=3)
    sample = samples.sample_at(0)
    # loss_mask marks targets: token 4 (predicted from the EOD input) is not one.
    assert sample["loss_mask"].tolist() == [1, 1, 1, 1, 0, 1]


def test_mock_documents_are_seeded_long_tailed_and_in_vocabulary():
    documents = mock_documents(seed=5, seq_length=128, vocab_size=128, num_documents=2000)
    again = mock_documents(seed=5, seq_length=128, vocab_size=128, num_documents=2000)
    assert numpy.array_equal(documents.lengths, again.lengths)
    assert numpy.array_equal(documents.read(7, 0, 20), again.read(7, 0, 20))
    assert documents.lengths.min() >= 2 and (documents.lengths > 128).sum() > 0
    assert numpy.median(documents.lengths) < 40  # long-tailed: median ~ seq_length / 5
    tokens = numpy.concatenate([documents.read(d, 0, int(documents.lengths[d])) for d in range(50)])
    assert tokens.min() >= 1 and tokens.max() <= 126  # never 0 nor the EOD id (127)


def test_fixed_rows_are_the_dynamic_paths_padded_rows():
    documents = _collection([7, 12])
    samples = SplitSamples(documents, 0, 2, max_length=16, seed=0, split_index=0)
    dataset = DocumentSampleDataset(samples, num_samples=4, seq_length=16)
    assert len(dataset) == 4
    row = dataset[1]
    sample = samples.sample_at(1)
    step = plan_fixed_microbatches(
        [len(sample["tokens"])], dp_size=1, micro_batch_size=1, seq_length=16
    ).steps[0]
    (expected,) = materialize_microbatches(
        step, 0, {0: sample}, BatchSchema(), layout="padded", sample_multiple=1
    )
    assert set(row) == set(expected) - {"cu_seqlens"}
    for key, value in row.items():
        assert torch.equal(value, expected[key][0]), key
    assert row["loss_mask"].sum() == len(sample["tokens"]) - 1


def test_fixed_rows_of_validation_and_test_load_at_megatrons_eval_micro_batch_size():
    """A probe: Megatron's loader reads a dataset's ``split`` to use --eval-micro-batch-size for
    validation and test; without it the fixed baseline ran them at --micro-batch-size (pp 2: a
    stage sent a shape its peer did not expect; dp 2: twice the samples an iteration)."""
    from megatron.core.datasets.utils import Split

    documents = _collection([7, 12, 5])
    for index, split in enumerate((Split.train, Split.valid, Split.test)):
        samples = SplitSamples(documents, 0, 3, max_length=16, seed=0, split_index=index)
        assert DocumentSampleDataset(samples, num_samples=3, seq_length=16).split == split


def test_batch_stream_serves_consecutive_positions_from_the_consumed_counter():
    documents = _collection([4, 9, 2, 14, 6, 5, 8, 3, 11, 7])
    samples = SplitSamples(documents, 0, 10, max_length=8, seed=2, split_index=0)
    stream = DocumentBatchStream(samples, batch_size=3, start=6, num_samples=13)
    batch = next(stream)
    assert batch.lengths() == samples.lengths_at(range(6, 9))
    loaded = batch.load([0, 2])
    assert torch.equal(loaded[2]["tokens"], samples.sample_at(8)["tokens"])
    assert next(stream).lengths() == samples.lengths_at(range(9, 12))
    with pytest.raises(StopIteration):
        next(stream)  # positions 12..14 exceed num_samples=13


def test_streams_start_where_megatrons_loaders_start():
    # After --load: training and validation continue from their counters, the test split is
    # scored from its start; --skip-train scores validation from its start too, as Megatron's
    # loader (and so --document-samples) does: a checkpoint scored alone was scored elsewhere.
    assert stream_starts(40, 16, skip_train=False) == (40, 16, 0)
    assert stream_starts(40, 16, skip_train=True) == (40, 0, 0)
    assert stream_starts(0, 0, skip_train=True) == (0, 0, 0)


def test_preprocess_writes_megatrons_format_with_byte_tokens(tmp_path):
    corpus = tmp_path / "corpus.jsonl"
    texts = ["hello", "", "é ∑ end"]
    corpus.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    preprocess.main(
        ["--input", str(corpus), "--output-prefix", str(tmp_path / "c"), "--append-eod"]
    )
    prefix = str(tmp_path / "c_text_document")
    dataset = IndexedDataset(prefix)
    assert len(dataset) == 3  # the empty text still has its EOD
    for index, text in enumerate(texts):
        expected = list(text.encode("utf-8")) + [preprocess.BYTE_EOD]
        assert dataset[index].tolist() == expected
    documents = indexed_documents([prefix, prefix])
    assert documents.lengths.tolist() == [6, 1, 11, 6, 1, 11]
    assert documents.read(5, 2, 3).tolist() == list("é ∑ end".encode("utf-8"))[2:5]


def test_preprocess_reports_bad_input_in_one_line(tmp_path, capsys):
    corpus = tmp_path / "bad.jsonl"
    corpus.write_text('{"text": "ok"}\n{"body": "no text key"}\n')
    with pytest.raises(SystemExit) as exit_info:
        preprocess.main(["--input", str(corpus), "--output-prefix", str(tmp_path / "c")])
    assert exit_info.value.code == 2
    assert "bad.jsonl:2: expected an object with a string 'text' field" in capsys.readouterr().err


def test_indexed_documents_name_a_missing_prefix(tmp_path):
    with pytest.raises(DynBatchValueError, match="not found; pass the prefix"):
        indexed_documents([str(tmp_path / "nothing")])


# --- SFT conversations (--sft): one sample per line, truncated, loss on the responses only -------


def _conversation_file(tmp_path):
    lines = [
        {
            "messages": [
                {"role": "system", "content": "Be brief."},
                {"role": "user", "content": "What is pp?"},
                {"role": "assistant", "content": "Pipeline parallelism."},
                {"role": "user", "content": "And dp?"},
                {"role": "assistant", "content": "Data parallelism."},
            ]
        },
        {
            "messages": [
                {"role": "system", "content": "One."},
                {"role": "user", "content": "a"},
                {"role": "assistant", "content": "b"},
                {"role": "system", "content": "Two."},
                {"role": "user", "content": "unanswered"},
            ]
        },
    ]
    path = tmp_path / "conversations.jsonl"
    path.write_text(json.dumps(lines[0]) + "\n\n" + json.dumps(lines[1]) + "\n")
    return path


def test_byte_template_trains_the_assistant_tokens_only():
    from megatron_dynbatch.integrations.megatron_lm.data.conversations import (
        byte_conversation_tokenizer,
    )

    tokenize = byte_conversation_tokenizer()
    conversation = [
        {"role": "system", "content": "sys"},
        {"role": "user", "content": "question"},
        {"role": "assistant", "content": "answer é"},
    ]
    tokens, mask = tokenize(conversation)
    assert tokens.dtype == numpy.int64 and mask.dtype == numpy.float32
    assert tokens.shape == mask.shape and int(tokens[-1]) == preprocess.BYTE_EOD
    text = bytes(int(t) for t in tokens[:-1]).decode("utf-8")
    assert text == "<|system|>\nsys\n<|user|>\nquestion\n<|assistant|>\nanswer é\n"
    trained = bytes(int(t) for t, m in zip(tokens[:-1], mask[:-1], strict=True) if m)
    assert trained.decode("utf-8") == "answer é\n" and mask[-1] == 1.0
    # Without a final answer nothing of the conversation, the end token included, is trained.
    _, mask = tokenize(conversation[:2])
    assert not mask.any()


def test_lines_whose_answer_the_token_budget_cuts_off_are_warned_about(tmp_path, capsys):
    """A probe: under --oversize-samples truncate dynamic batching cuts samples at the token
    budget, below --seq-length; 20 of 40 lines then trained nothing, counted only as truncated
    tokens. The first answers of the file's two answered lines start at tokens 54 and 41."""
    from megatron_dynbatch.integrations.megatron_lm.data.conversations import (
        byte_conversation_tokenizer,
    )
    from megatron_dynbatch.integrations.megatron_lm.data.documents import conversation_documents

    path = _conversation_file(tmp_path)
    tokenize = byte_conversation_tokenizer()
    conversation_documents([str(path)], tokenize, seq_length=60, cut=(45, "--max-tokens-per-gpu"))
    out = capsys.readouterr().out
    assert "1 samples start their first answer at or after --max-tokens-per-gpu 45, where " in out
    assert "--seq-length" not in out, out
    conversation_documents([str(path)], tokenize, seq_length=60)  # nothing cut below 60
    assert "first answer" not in capsys.readouterr().out
    # What the launch passes: the cap samples are cut to (the planner's: rounded down to the
    # sample multiple), only where truncate cuts below --seq-length; YAML settings count.
    from megatron_dynbatch.integrations.megatron_lm.arguments import truncation_from_args
    from tests._support import megatron_lm_args

    def cut(argv, **values):
        return truncation_from_args(megatron_lm_args(argv, **{"seq_length": 1024, **values}))

    run = ["--use-dynamic-batch-size", "--max-tokens-per-gpu", "513"]
    assert cut([*run, "--oversize-samples", "truncate"], tensor_model_parallel_size=2) == (
        512, "--max-tokens-per-gpu",
    )  # fmt: skip
    yaml = tmp_path / "dyn.yaml"
    yaml.write_text("oversize_samples: truncate\nmax_tokens_per_gpu: 300\n")
    assert cut(["--use-dynamic-batch-size", "--dynamic-batch-config", str(yaml)]) == (
        300, "--max-tokens-per-gpu",
    )  # fmt: skip
    for other in (
        [*run, "--oversize-samples", "allow"],
        [*run, "--oversize-samples", "truncate", "--max-tokens-per-gpu", "1024"],
        ["--max-tokens-per-gpu", "513", "--oversize-samples", "truncate"],
    ):
        assert cut(other) is None, other


def test_a_line_is_one_sample_truncated_as_megatrons_sft_dataset(tmp_path, capsys):
    from megatron_dynbatch.integrations.megatron_lm.data.conversations import (
        byte_conversation_tokenizer,
    )
    from megatron_dynbatch.integrations.megatron_lm.data.documents import conversation_documents

    tokenize = byte_conversation_tokenizer()
    path = _conversation_file(tmp_path)
    unanswered = {"messages": [{"role": "user", "content": "no answer here"}]}
    with open(path, "a") as handle:
        handle.write(json.dumps(unanswered) + "\n")
    documents = conversation_documents([str(path)], tokenize, seq_length=40)
    records = [json.loads(line) for line in path.read_text().splitlines() if line]
    # A line is a sample; its conversations (split at system messages) are concatenated.
    expected = [
        tokenize(records[0]["messages"]),
        [numpy.concatenate(p) for p in zip(tokenize(records[1]["messages"][:3]),
                                           tokenize(records[1]["messages"][3:]), strict=True)],
        tokenize(records[2]["messages"]),
    ]  # fmt: skip
    assert len(documents) == 3 and documents.truncate
    for index, (tokens, mask) in enumerate(expected):
        assert int(documents.lengths[index]) == tokens.shape[0]
        assert numpy.array_equal(documents.read(index, 0, tokens.shape[0]), tokens)
        assert numpy.array_equal(documents.read_loss_mask(index, 3, 9), mask[3:12])
    # One warning with the counts: the blank line, the line without an answer, and the first two
    # lines, whose first answers start at tokens 54 and 41 (truncation leaves them without loss).
    out = capsys.readouterr().out
    assert out.count("WARNING:") == 1
    assert "1 blank lines skipped" in out
    assert "1 of 3 samples have no assistant turn and train with zero loss tokens" in out
    assert "2 samples start their first answer at or after --seq-length 40" in out
    # Issue 29: each cause with its own fix; a longer --seq-length only for truncation.
    assert "no assistant turn and train with zero loss tokens (give them an assistant answer" in out
    assert out.count("raise --seq-length") == 1
    assert "without loss tokens (raise --seq-length, or shorten their prompts)" in out
    # As samples: a line longer than max_length is cut at the right, never split into pieces.
    samples = SplitSamples(documents, 0, 3, max_length=40, seed=0, split_index=0)
    assert len(samples) == 3
    seen = set()
    for position in range(3):
        index = int(samples.document[samples._piece(position)])
        sample = samples.sample_at(position)
        tokens, mask = expected[index]
        assert torch.equal(sample["tokens"], torch.as_tensor(tokens[:40]))
        assert torch.equal(sample["loss_mask"], torch.as_tensor(mask[:40]))
        seen.add(index)
    assert seen == {0, 1, 2}
    assert samples.lengths_at(range(3)) == [
        min(40, expected[int(samples.document[samples._piece(p)])][0].shape[0]) for p in range(3)
    ]


@pytest.mark.parametrize(
    "line, message",
    [
        ("not json", "conversations.jsonl:2: not a JSON object"),
        ('{"text": "hi"}', 'needs a non-empty "messages" list'),
        ('{"messages": [{"role": "bot", "content": "x"}]}', "message 0 is"),
        ('{"messages": [{"role": "user", "content": 3}]}', "a string content"),
    ],
)
def test_bad_conversation_lines_name_the_file_and_line(tmp_path, line, message):
    from megatron_dynbatch.integrations.megatron_lm.data.conversations import (
        byte_conversation_tokenizer,
        read_conversations,
    )

    path = tmp_path / "conversations.jsonl"
    good = {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}
    path.write_text(json.dumps(good) + "\n" + line + "\n")
    with pytest.raises(DynBatchValueError, match=message) as raised:
        read_conversations([str(path)], byte_conversation_tokenizer())
    assert f"{path}:2" in str(raised.value)
    with pytest.raises(DynBatchValueError, match="no such file"):
        read_conversations([str(tmp_path / "missing.jsonl")], byte_conversation_tokenizer())


def test_conversation_tokenizer_needs_byte_vocabulary_or_a_conversation_tokenizer():
    from megatron.core.tokenizers.text.libraries.null_tokenizer import NullTokenizer

    from megatron_dynbatch.integrations.megatron_lm.data.conversations import conversation_tokenizer

    tokenize = conversation_tokenizer(NullTokenizer(257), "NullTokenizer")
    assert tokenize([{"role": "assistant", "content": "x"}])[1].any()
    with pytest.raises(DynBatchValueError, match="--vocab-size 257"):
        conversation_tokenizer(NullTokenizer(128), "NullTokenizer")

    class Words:
        def tokenize_conversation(self, conversation, return_target, add_generation_prompt):
            raise NotImplementedError("This method is supported only for SFTTokenizer.")

    with pytest.raises(DynBatchValueError, match="SFTTokenizer"):
        conversation_tokenizer(Words(), "HuggingFaceTokenizer")

    class Sft:  # Megatron's SFTTokenizer contract: targets are IGNORE_INDEX where not trained
        def tokenize_conversation(self, conversation, return_target, add_generation_prompt):
            assert return_target and not add_generation_prompt
            tokens = numpy.arange(5)
            return tokens, numpy.where(tokens >= 3, tokens, -100)

    tokens, mask = conversation_tokenizer(Sft(), "SFTTokenizer")([{"role": "user", "content": ""}])
    assert tokens.tolist() == [0, 1, 2, 3, 4] and mask.tolist() == [0, 0, 0, 1, 1]
