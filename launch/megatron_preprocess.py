"""Megatron-LM's own ``tools/preprocess_data.py``, runnable here (Python 3.11, no triton).

    MEGATRON_LM_DIR=/path/to/Megatron-LM python launch/megatron_preprocess.py \\
        --input data/pydoc.jsonl --output-prefix data/pydoc_sp --append-eod --workers 2 \\
        --tokenizer-type SentencePieceTokenizer --tokenizer-model data/pydoc_sp.model

Every argument but a leading ``--megatron-lm-dir DIR`` (instead of ``$MEGATRON_LM_DIR``) goes to
the tool unchanged. See ``megatron_dynbatch/integrations/megatron_lm/data/megatron_tool.py`` for
what is provided before it runs, and docs/megatron_lm_data.md, "A real tokenizer".
"""

import pathlib
import sys

REPO = pathlib.Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from megatron_dynbatch.integrations.megatron_lm.data.megatron_tool import main  # noqa: E402

if __name__ == "__main__":
    main()
