"""Issue 44: a ``--dynamic-batch-config`` YAML error names the file and the key, and a key the
command line overrides is neither checked nor used (``max_tokens_per_gpu: lots`` with
``--max-tokens-per-gpu 1024`` runs; ``max_memory_gib: 8GB`` likewise)."""

import pytest

from megatron_dynbatch.config import load_yaml_config
from megatron_dynbatch.errors import DynBatchValueError
from megatron_dynbatch.integrations.megatron_lm.arguments import dynbatch_config_from_args
from tests._support import megatron_lm_args

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(
    "key, value, flag, given, resolved",
    [
        ("max_tokens_per_gpu", "lots", "--max-tokens-per-gpu", "1024", 1024),
        ("max_memory_gib", "8GB", "--max-memory-gib", "8", 8.0),
        ("oversize_samples", "sometimes", "--oversize-samples", "truncate", "truncate"),
    ],
)
def test_a_bad_key_names_the_file_and_key_unless_the_command_line_overrides_it(
    tmp_path, key, value, flag, given, resolved
):
    path = tmp_path / "dynbatch.yaml"
    path.write_text(f"{key}: {value}\nlayout: padded\n")
    argv = ["--use-dynamic-batch-size", "--dynamic-batch-config", str(path)]
    if key != "max_tokens_per_gpu":
        argv += ["--max-tokens-per-gpu", "512"]
    with pytest.raises(DynBatchValueError) as refused:
        dynbatch_config_from_args(megatron_lm_args(argv))
    message = str(refused.value)
    assert message.startswith(f"--dynamic-batch-config {str(path)!r}, key {key}: {value!r}")
    assert f"Fix {key} in that file, or give {flag} on the command line" in message
    # Overridden on the command line: the file's value is not read, the rest of the file is.
    config = dynbatch_config_from_args(megatron_lm_args([*argv, flag, given]))
    assert getattr(config, key) == resolved
    assert config.layout == "padded"
    assert key not in load_yaml_config(path, overridden={key})
