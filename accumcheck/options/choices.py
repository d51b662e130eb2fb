"""The values a run's settings may take: parameter and buffer dtypes, accumulation modes, loss
normalisations, fault kinds, what fails a run, seeds, training stacks and their faults. The
options (``accumcheck.options``), case files, faults and reports all check against these."""

DTYPES = ("float32", "bfloat16", "float16")
ACCUM_DTYPES = ("float32", "float64")
MODES = ("native", "accumulator", "compensated")
REDUCTIONS = ("mean", "sum", "token_count")
FAULT_KINDS = ("drop-step", "repeat-step", "double-step", "scale", "bf16", "roundoff")
# What fails a run (exit 1): every flagged tensor ("marginal", the default), only the decisive ones
# ("diverged"), or suspicious ones too ("suspicious", what --strict means).
FAIL_ON = ("suspicious", "marginal", "diverged")
SEED_LIMIT = 2**32  # numpy, torch and mxnet all take seeds below it

# "loop": your own PyTorch loop (one process or DistributedDataParallel); "fsdp2" and "deepspeed" shard it
STACKS = ("transformers", "accelerate", "lightning", "gluon", "loop", "fsdp2", "deepspeed")
# rank-loss-scaled, rank-drops-micro-batch and bfloat16-reduce break one rank of a data-parallel run, and
# step-per-context-batch a Gluon Trainer on several contexts (--world-size 2 or more)
STACK_FAULTS = ("micro-batch-mean", "loss-over-n", "step-per-micro-batch", "rank-loss-scaled",
                "rank-drops-micro-batch", "bfloat16-reduce", "step-per-context-batch")
