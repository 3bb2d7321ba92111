"""Your own trainer on megatron_dynbatch, a Megatron-Core loop at pp 2 (docs/integrating.md): run
``torchrun --nproc-per-node 2 examples/minimal_host.py`` (gloo on CPU, NCCL on GPUs)."""

# ruff: noqa: E402  (megatron.core is imported after the CPU shim)
import torch
import torch.distributed as dist

from megatron_dynbatch import BatchSchema, ParallelLayout, materialize_microbatches, plan_schedule
from megatron_dynbatch.cpu.core_shim import apply_cpu_shim
from megatron_dynbatch.integrations.hosts import Host, host_config, register_host

apply_cpu_shim()  # only without CUDA: Megatron's few CUDA calls go to the CPU
from megatron.core import parallel_state as ps
from megatron.core.distributed import DistributedDataParallel as DDP
from megatron.core.distributed import DistributedDataParallelConfig
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
from megatron.core.transformer import TransformerConfig

from megatron_dynbatch.mcore.agreement import step_agreement
from megatron_dynbatch.mcore.step import configure_loss, train_microbatches

# fmt: off
TOY = register_host(Host(  # our own option names: host_config's errors name them
    name="toy", switch="toy.dynamic=true", fallback="toy.dynamic=false", planning="global",
    options={"tokens_per_mb": "max_tokens_per_gpu"}, keys={"max_tokens_per_gpu": "toy.tokens_per_mb"},
    oversize="error", layout_flags={"pp_size": "toy.pp"}))
dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
ps.initialize_model_parallel(pipeline_model_parallel_size=2)
model_parallel_cuda_manual_seed(1234)  # Megatron's RNG tracker: needed before a model is built
config = TransformerConfig(num_layers=2, hidden_size=32, num_attention_heads=4, use_cpu_initialization=True,
    pipeline_model_parallel_size=2, pipeline_dtype=torch.float32, calculate_per_token_loss=True,
    masked_softmax_fusion=False, bias_activation_fusion=False, bias_dropout_fusion=False,
    gradient_accumulation_fusion=False, hidden_dropout=0.0, attention_dropout=0.0)
last = ps.is_pipeline_last_stage()
gpt = GPTModel(config=config, transformer_layer_spec=get_gpt_layer_local_spec(), vocab_size=64,
    max_sequence_length=128, pre_process=ps.is_pipeline_first_stage(), post_process=last,
    share_embeddings_and_output_weights=False)
# fmt: on
model = [DDP(config, DistributedDataParallelConfig(), gpt)]
configure_loss(model, "token-mean")  # exact loss: Megatron's per-token normalisation
planner = host_config(TOY, {"tokens_per_mb": 96}, ParallelLayout(pp_size=2))
for step in range(3):
    g = torch.Generator().manual_seed(step)
    lengths = torch.randint(4, 90, (12,), generator=g).tolist()  # very different lengths
    samples = {i: {"tokens": torch.randint(64, (n,), generator=g)} for i, n in enumerate(lengths)}
    plan = plan_schedule(lengths, config=planner)  # every rank derives the same plan
    for planned in plan.steps:  # one optimizer step each
        rows = dict(layout=plan.layout, sample_multiple=plan.sample_multiple)
        with step_agreement(what=f"step {step}") as agreement:  # one rank's error stops all ranks
            agreement.fingerprint = plan.fingerprint()  # and every rank planned alike
            batches = materialize_microbatches(planned, 0, samples, BatchSchema(), **rows)
        logs = train_microbatches(model, planned, batches, aggregation="token-mean")
        with torch.no_grad():  # SGD on the gradients Megatron's DDP reduced into main_grad
            for p in gpt.parameters():
                p -= 0.1 * p.main_grad
        model[0].zero_grad_buffer()
        if last:  # each micro-batch logs [loss sum, tokens]
            loss = sum(log["loss"] for log in logs)
            print(f"step {step}: {len(logs)} micro-batches, loss {float(loss[0] / loss[1]):.4f}")
dist.barrier()  # close the groups on every rank before exit: left to exit, gloo's threads can abort one
dist.destroy_process_group()
