"""The example Job's training script (mounted from a ConfigMap): vramwatch.start() in every rank.

torchrun starts one process per GPU; each calls vramwatch.start(), and the first starts the pod's scrape
server on port 9488 (settings from the Job's VRAMWATCH_* environment). Replace the loop with your own.

Environment: TRAIN_STEPS (default 1000; 0 = no step limit), TRAIN_SECONDS (0 = no time limit),
HIDDEN (model width, default 4096).
"""

from __future__ import annotations

import os
import time

import torch

import vramwatch


def main() -> int:
    vramwatch.start()  # raises ConfigError for a bad VRAMWATCH_* value, before any training
    rank, local_rank = int(os.environ.get("RANK", "0")), int(os.environ.get("LOCAL_RANK", "0"))
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    if rank == 0:
        print(
            f"vramwatch example: pod {os.environ.get('POD_NAME', '?')} in {os.environ.get('POD_NAMESPACE', '?')}"
            f" on node {os.environ.get('NODE_NAME', '?')}, {os.environ.get('WORLD_SIZE', '1')} ranks, {device}",
            flush=True,
        )
    hidden = int(os.environ.get("HIDDEN", "4096"))
    model = torch.nn.Sequential(torch.nn.Linear(hidden, hidden), torch.nn.GELU(), torch.nn.Linear(hidden, hidden))
    model = model.to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x = torch.randn(64, hidden, device=device)
    steps = int(os.environ.get("TRAIN_STEPS", "1000"))
    seconds = float(os.environ.get("TRAIN_SECONDS", "0"))
    end = time.monotonic() + seconds if seconds > 0 else float("inf")
    step = 0
    while (steps <= 0 or step < steps) and time.monotonic() < end:
        loss = model(x).pow(2).mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        step += 1
        vramwatch.step(loss=loss.detach())
    vramwatch.stop()
    if rank == 0:
        print(f"vramwatch example: {step} steps done", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
