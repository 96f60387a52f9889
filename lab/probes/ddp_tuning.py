"""Probe (not part of the book): the step-graph DDP step of WRN-28-10 under DDP settings.

    python scripts/probes/ddp_tuning.py OUT.jsonl [BUDGET_S [VARIANT@BATCH ...]]

Runs ``python -m lab.step_timing --capture --compile default`` on one GPU
(the reference) and on two under each variant below — DDP's bucket size, gradients as bucket
views, a bf16 all-reduce, NCCL's multiprocessor limit ``NCCL_MAX_CTAS`` and its protocol
``NCCL_PROTO`` — at 128 images per GPU (weak scaling) and, for some, 64 (the post's batch of
128 split over two GPUs). No run starts after BUDGET_S seconds (default 480); without
VARIANT@BATCH names (``ctas8@64``), all run. The NCCL log lines that give each run's channel
count are printed (``NCCL_DEBUG=INFO``). The table gives each step's time, the compute alone
(``no_sync``) and the speed-up over the one-GPU step graph at the same global (strong) or
per-GPU (weak) batch.
"""

import json
import sys
import tempfile
import time
from pathlib import Path

from tutorial_utils.launch import torchrun

# name: (step_timing flags, extra environment, per-GPU batches)
VARIANTS = {
    "default": ([], {}, (128, 64)),
    "bf16": (["--bf16-grads"], {}, (128,)),
    "view": (["--bucket-view"], {}, (128,)),
    "bf16+view": (["--bf16-grads", "--bucket-view"], {}, (128, 64)),
    "ctas8": ([], {"NCCL_MAX_CTAS": "8"}, (128, 64)),
    "ctas8+bf16+view": (["--bf16-grads", "--bucket-view"], {"NCCL_MAX_CTAS": "8"}, (128, 64)),
    "ctas4": ([], {"NCCL_MAX_CTAS": "4"}, (128, 64)),
    "ctas16": ([], {"NCCL_MAX_CTAS": "16"}, (128,)),
    "ctas4+bf16+view": (["--bf16-grads", "--bucket-view"], {"NCCL_MAX_CTAS": "4"}, (128, 64)),
    "100MB+bf16+view": (["--bf16-grads", "--bucket-view", "--bucket-mb", "100"], {}, (128,)),
    # NCCL's wire protocol, which it otherwise picks per message size: LL and LL128 poll
    # flags in the data on the multiprocessors, Simple synchronises per chunk
    "simple": ([], {"NCCL_PROTO": "Simple"}, (128, 64)),
    "ll128": ([], {"NCCL_PROTO": "LL128"}, (128, 64)),
    "ll": ([], {"NCCL_PROTO": "LL"}, (128,)),
    # all 146 MB of WRN-28-10's gradients in one bucket: one all-reduce after backward
    "one-bucket": (["--bucket-mb", "200"], {}, (128, 64)),
    "one-bucket+bf16+view": (["--bf16-grads", "--bucket-view", "--bucket-mb", "200"], {},
                             (128, 64)),
}


def step_timing(nproc: int, batch: int, flags: list[str], env: dict) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "st.jsonl"
        args = ["--model", "wrn-28-10", "--batch", str(batch), "--compile", "default",
                "--capture", "--device", "cuda", "--repeats", "30", "--out", str(out), *flags]
        result = torchrun("lab.step_timing", args, nproc=nproc,
                          timeout_s=300, metrics_file=out, echo=False,
                          env={"NCCL_DEBUG": "INFO", "NCCL_DEBUG_SUBSYS": "INIT,TUNING", **env})
    channels = [line for line in result.output.splitlines() if "channels" in line.lower()]
    return {**result.metrics[0], "nccl_channels": channels[:4]}


out_path = Path(sys.argv[1])
budget_s = float(sys.argv[2]) if len(sys.argv) > 2 else 480
chosen = sys.argv[3:] or [f"{n}@{b}" for n, (_, _, batches) in VARIANTS.items()
                          for b in batches]
t0 = time.perf_counter()
single = {b: step_timing(1, b, [], {}) for b in (64, 128)}
rows = []
for run in chosen:
    name, batch = run.split("@")
    flags, env, _ = VARIANTS[name]
    if time.perf_counter() - t0 > budget_s:
        print(f"{run}: not started, budget spent", flush=True)
        continue
    try:
        rec = step_timing(2, int(batch), flags, env)
    except Exception as err:  # one failed variant must not lose the others
        print(f"{run}: failed: {str(err)[-300:]}", flush=True)
        continue
    rec["variant"], rec["env"] = name, env
    rows.append(rec)
    with open(out_path, "a") as f:
        f.write(json.dumps(rec) + "\n")
    print(f"{run}: {rec['ddp_ms']:.2f} ms", *rec["nccl_channels"][:2], sep="\n  ", flush=True)

print(f"\none GPU, step graph: 64 -> {single[64]['ddp_ms']:.2f} ms, "
      f"128 -> {single[128]['ddp_ms']:.2f} ms")
print(f"{'variant':<18}{'batch/GPU':>10}{'step ms':>9}{'no_sync':>9}{'speed-up':>9}")
for r in rows:
    b = r["per_gpu_batch"]
    # weak: 2 x b images against one GPU's b; strong (64): 128 against one GPU's 128
    ref_ms = single[b]["ddp_ms"] if b == 128 else single[128]["ddp_ms"]
    ref_images = b if b == 128 else 128
    speedup = (2 * b / r["ddp_ms"]) / (ref_images / ref_ms)
    print(f"{r['variant']:<18}{b:>10}{r['ddp_ms']:>9.2f}{r['no_sync_ms']:>9.2f}{speedup:>8.2f}x")
