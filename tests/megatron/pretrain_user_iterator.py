"""Your own data iterator with launch/pretrain_gpt_dynbatch.py: what test_pretrain.py runs.

    torchrun --nproc-per-node 2 tests/megatron/pretrain_user_iterator.py <GPT arguments> \\
        --use-dynamic-batch-size --max-tokens-per-gpu 256 [--rollouts-per-step 4]

It does what README.md ("Your own data") shows: run the launch script's set-up (patched
``megatron.training``, CPU support) without its ``main``, then call ``main`` with a dataset provider
(through ``run_program``, which ends the process without Python's slow teardown)
whose training iterator yields :class:`RolloutBatch` objects. Rollout ``r`` has ``USER_GROUP_SIZE``
samples of seeded random lengths; each batch holds rollouts ``[b * R, (b + 1) * R)`` with
``R = USER_ROLLOUTS_PER_BATCH``. After ``--load`` the iterator starts at rollout
``args.consumed_train_samples`` (the contract of ``training_hooks``), so a batch interrupted by a
checkpoint resumes with its remaining rollouts.
"""

import os
import pathlib
import runpy
from functools import partial

import torch

REPO = pathlib.Path(__file__).resolve().parents[2]
runpy.run_path(str(REPO / "launch" / "pretrain_gpt_dynbatch.py"), run_name="setup")

from megatron.training import get_args  # noqa: E402

from megatron_dynbatch.integrations.megatron_lm.launch import run_program  # noqa: E402
from megatron_dynbatch.integrations.megatron_lm.pretrain_gpt import main  # noqa: E402
from megatron_dynbatch.runtime.batches import RolloutBatch  # noqa: E402

ROLLOUTS_PER_BATCH = int(os.environ.get("USER_ROLLOUTS_PER_BATCH", "8"))
GROUP_SIZE = int(os.environ.get("USER_GROUP_SIZE", "1"))
VOCAB = 128
MAX_LENGTH = 100


def rollout(index: int):
    generator = torch.Generator().manual_seed(10_000 + index)
    samples = []
    for _ in range(GROUP_SIZE):
        length = int(torch.randint(4, MAX_LENGTH, (1,), generator=generator))
        samples.append({"tokens": torch.randint(1, VOCAB - 1, (length,), generator=generator)})
    return samples


def batches(first_rollout: int):
    position = first_rollout
    while True:
        end = (position // ROLLOUTS_PER_BATCH + 1) * ROLLOUTS_PER_BATCH
        samples, rollout_ids = [], []
        for index in range(position, end):
            members = rollout(index)
            samples.extend(members)
            rollout_ids.extend([index] * len(members))
        yield RolloutBatch(samples=samples, rollout_ids=rollout_ids)
        position = end


def provider(num_samples, vp_stage=None):
    del num_samples, vp_stage
    return batches(get_args().consumed_train_samples), None, None


provider.is_distributed = True

if __name__ == "__main__":
    run_program(partial(main, datasets_provider=provider))
