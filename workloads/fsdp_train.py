"""FSDP2 training of a small transformer under Ray Train, with checkpoint recovery.

Runs unchanged as a RayJob entrypoint on any cluster (``python fsdp_train.py
...``) or as ``python -m workloads.fsdp_train``: it imports only Ray, torch and
the standard library.

* The model is a small decoder-only transformer sharded with FSDP2
  (``fully_shard``): gloo over an explicit CPU device mesh on CPU nodes, NCCL
  and ``use_gpu`` when ``--gpus-per-worker`` is set.
* Data are synthetic and keyed by ``(seed, step)``: every run, interrupted or
  not, sees the same global batch at the same step, so a resumed run can be
  compared with an uninterrupted one.
* Every ``--checkpoint-every`` steps the sharded model and optimizer state and
  the step are saved with ``torch.distributed.checkpoint`` and reported to Ray
  Train under ``--storage-path``/``--name``; a restarted worker group resumes
  from ``ray.train.get_checkpoint()``.
* One JSON line per event goes to stdout, prefixed with ``RAYPROOF_EVENT``
  (see :data:`EVENT_MARKER`), so a test or operator can follow progress, lost
  work and hangs from outside.  On failure the program exits non-zero with a
  one-line reason.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import os
import re
import shutil
import socket
import sys
import tempfile
import time

os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
# Every rank's events must reach the driver's output as they are: Ray's log
# deduplication would fold the ranks' `collective` lines (equal but for their
# numbers) into one "[repeated Nx across cluster]" line.
os.environ.setdefault("RAY_DEDUP_LOGS", "0")

EVENT_MARKER = "RAYPROOF_EVENT"
# The collective timeout is the platform's, not the program's: a golden
# training image or job template sets it in this variable (seconds), and the
# program passes it to Ray Train's TorchConfig. Unset, Ray Train's own default
# applies (TorchConfig.timeout_s, 1800 s in Ray 2.60): what a team gets from a
# platform that never tuned it. ``--timeout-s`` overrides both.
COLLECTIVE_TIMEOUT_ENV = "COLLECTIVE_TIMEOUT_S"


def emit(event: str, **fields) -> None:
    """Print one event line with a wall-clock timestamp."""
    record = {"event": event, "ts": round(time.time(), 3), **fields}
    print(f"{EVENT_MARKER} {json.dumps(record, sort_keys=True)}", flush=True)


@contextlib.contextmanager
def collective(op: str, step: int, rank: int):
    """Brackets one synchronised phase of a step on one rank with ``collective``
    events (``phase`` begin/end): FSDP's forward and backward (all-gather of
    each block's parameters, reduce-scatter of its gradients), the loss
    all-reduce, a checkpoint (``torch.distributed.checkpoint`` plans
    collectively; ``ray.train.report`` is a barrier). From outside, a fault
    then shows whether it landed while a rank was inside one."""
    emit("collective", phase="begin", op=op, step=step, rank=rank)
    yield
    emit("collective", phase="end", op=op, step=step, rank=rank)


# ---------------------------------------------------------------------------
# Model and data (executed on the training workers)
# ---------------------------------------------------------------------------

def build_model(vocab: int, d_model: int, n_layers: int, n_heads: int, seq_len: int):
    import torch
    import torch.nn.functional as F
    from torch import nn

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.ln1 = nn.LayerNorm(d_model)
            self.qkv = nn.Linear(d_model, 3 * d_model)
            self.proj = nn.Linear(d_model, d_model)
            self.ln2 = nn.LayerNorm(d_model)
            self.mlp = nn.Sequential(nn.Linear(d_model, 4 * d_model), nn.GELU(), nn.Linear(4 * d_model, d_model))

        def forward(self, x):
            b, t, d = x.shape
            q, k, v = self.qkv(self.ln1(x)).split(d, dim=-1)
            shape = (b, t, n_heads, d // n_heads)
            q, k, v = (z.view(shape).transpose(1, 2) for z in (q, k, v))
            a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
            return x + self.mlp(self.ln2(x))

    class TinyLM(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.tok = nn.Embedding(vocab, d_model)
            self.pos = nn.Parameter(torch.zeros(seq_len, d_model))
            self.blocks = nn.ModuleList(Block() for _ in range(n_layers))
            self.ln = nn.LayerNorm(d_model)
            self.head = nn.Linear(d_model, vocab)

        def forward(self, tokens):
            x = self.tok(tokens) + self.pos[: tokens.shape[1]]
            for block in self.blocks:
                x = block(x)
            return self.head(self.ln(x))

    return TinyLM()


def synthetic_batch(seed: int, step: int, batch: int, seq_len: int, vocab: int):
    """The global batch for ``step``: the same for every run with this seed.

    Sequences follow ``x[t+1] = (x[t] + stride) % vocab`` with a per-sequence
    stride, plus 5% noise, so the loss falls and its value at a given step is
    a fingerprint of the parameters that produced it.
    """
    import torch

    g = torch.Generator().manual_seed(seed * 1_000_003 + step)
    start = torch.randint(0, vocab, (batch, 1), generator=g)
    stride = torch.randint(1, 4, (batch, 1), generator=g)
    seq = (start + stride * torch.arange(seq_len + 1)) % vocab
    noise = torch.rand(batch, seq_len + 1, generator=g) < 0.05
    seq = torch.where(noise, torch.randint(0, vocab, seq.shape, generator=g), seq)
    return seq[:, :-1], seq[:, 1:]


def train_loop_per_worker(cfg: dict) -> None:
    import ray.train
    import ray.train.torch
    import ray.util
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    import torch.nn.functional as F
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    lead = rank == 0
    if cfg["global_batch"] % world:
        raise ValueError(f"global batch {cfg['global_batch']} is not divisible by world size {world}")

    use_gpu = cfg["gpus_per_worker"] > 0
    device = ray.train.torch.get_device() if use_gpu else torch.device("cpu")
    # Passing the mesh explicitly keeps FSDP2 on the CPU with gloo even where
    # CUDA is installed (its default mesh is CUDA when CUDA is available).
    mesh = init_device_mesh(device.type, (world,))

    torch.manual_seed(cfg["seed"])  # identical full init on every rank before sharding
    model = build_model(cfg["vocab"], cfg["d_model"], cfg["layers"], cfg["heads"], cfg["seq_len"]).to(device)
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg["lr"])

    start_step = 0
    checkpoint = ray.train.get_checkpoint()
    if checkpoint is not None:
        restoring = time.monotonic()
        with checkpoint.as_directory() as path:
            model_sd, optim_sd = get_state_dict(model, optimizer)
            state = {"model": model_sd, "optim": optim_sd}
            dcp.load(state, checkpoint_id=path)
            set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
            with open(os.path.join(path, "train_state.json")) as fh:
                start_step = json.load(fh)["step"]
        if lead:
            emit("checkpoint_restored", step=start_step, path=checkpoint.path, world_size=world,
                 seconds=round(time.monotonic() - restoring, 3))
    # Where each rank runs (its Ray node's address is its pod's IP): a fault
    # that must land while one rank is inside a collective finds its pod.
    emit("rank", rank=rank, ip=ray.util.get_node_ip_address(), host=socket.gethostname(), resume_step=start_step)
    if lead:
        emit("worker_group_started", world_size=world, resume_step=start_step,
             backend=dist.get_backend(), device=device.type)

    per_rank = cfg["global_batch"] // world
    loss_value = float("nan")
    for step in range(start_step + 1, cfg["steps"] + 1):
        began = time.monotonic()
        inputs, targets = synthetic_batch(cfg["seed"], step, cfg["global_batch"], cfg["seq_len"], cfg["vocab"])
        inputs = inputs[rank * per_rank:(rank + 1) * per_rank].to(device)
        targets = targets[rank * per_rank:(rank + 1) * per_rank].to(device)
        with collective("forward_backward", step, rank):
            logits = model(inputs)
            loss = F.cross_entropy(logits.reshape(-1, cfg["vocab"]), targets.reshape(-1))
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        global_loss = loss.detach().clone()
        if lead:
            # Rank 0 stands in for the slowest rank of a larger model: its
            # extra compute pads the step to --step-time-s *before* the
            # all-reduce, so the other ranks spend that time inside the
            # collective waiting for it, as ranks wait for the slowest on any
            # cluster. A fault during a step lands mid-collective.
            remaining = cfg["step_time_s"] - (time.monotonic() - began)
            if remaining > 0:
                time.sleep(remaining)  # sleep-ok: simulated compute, not synchronisation
        with collective("all_reduce", step, rank):
            # The end is the collective's completion, not the call's return:
            # NCCL returns once the all-reduce is enqueued on the GPU's stream.
            dist.all_reduce(global_loss, async_op=True).wait()  # the reported loss is the global mean
            if device.type == "cuda":
                torch.cuda.current_stream(device).synchronize()
        loss_value = global_loss.item() / world
        if not math.isfinite(loss_value):
            raise FloatingPointError(f"loss became {loss_value} at step {step}")
        if lead:
            emit("step", step=step, loss=round(loss_value, 6), world_size=world)

        if step % cfg["checkpoint_every"] == 0 or step == cfg["steps"]:
            saved = time.monotonic()
            local_dir = tempfile.mkdtemp(prefix=f"rayproof-ckpt-{step}-r{rank}-")
            try:
                with collective("checkpoint", step, rank):
                    model_sd, optim_sd = get_state_dict(model, optimizer)
                    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=local_dir)
                    if lead:
                        with open(os.path.join(local_dir, "train_state.json"), "w") as fh:
                            json.dump({"step": step, "loss": loss_value, "seed": cfg["seed"]}, fh)
                    # Every rank reports its own shard files; Ray Train merges them
                    # into one checkpoint directory under storage_path/name.
                    ray.train.report(
                        {"step": step, "loss": loss_value},
                        checkpoint=ray.train.Checkpoint.from_directory(local_dir),
                        checkpoint_dir_name=f"checkpoint_step_{step:06d}",
                    )
            finally:
                shutil.rmtree(local_dir, ignore_errors=True)
            if lead:
                emit("checkpoint_saved", step=step, seconds=round(time.monotonic() - saved, 3))


# ---------------------------------------------------------------------------
# Driver
# ---------------------------------------------------------------------------

def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--name", required=True, help="stable run name; a relaunch with the same name resumes")
    p.add_argument("--storage-path", required=True, help="shared path or object-store URI for checkpoints")
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--checkpoint-every", type=int, default=5, help="K: checkpoint every K steps")
    p.add_argument("--timeout-s", type=int, default=None,
                   help=f"collective timeout (TorchConfig.timeout_s); default: ${COLLECTIVE_TIMEOUT_ENV} from the "
                        "platform's environment, else Ray Train's own default")
    p.add_argument("--max-failures", type=int, default=1, help="FailureConfig.max_failures (-1 = forever)")
    p.add_argument("--cpus-per-worker", type=float, default=1.0)
    p.add_argument("--gpus-per-worker", type=float, default=0.0)
    p.add_argument("--memory-per-worker", type=int, default=0, help="bytes of Ray 'memory' resource per worker")
    p.add_argument("--worker-resource", action="append", default=[], metavar="NAME=AMOUNT",
                   help="extra custom resource per worker, e.g. rayproof_worker=1")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--step-time-s", type=float, default=0.0, help="minimum wall time per step")
    p.add_argument("--global-batch", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=32)
    p.add_argument("--vocab", type=int, default=64)
    p.add_argument("--d-model", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--ray-address", default=os.environ.get("RAY_ADDRESS", "auto"),
                   help="cluster to join; 'local' starts a single-node Ray here")
    args = p.parse_args(argv)
    if args.world_size < 1 or args.steps < 1 or args.checkpoint_every < 1:
        p.error("--world-size, --steps and --checkpoint-every must be positive")
    args.timeout_source = "--timeout-s" if args.timeout_s is not None else "Ray Train's default"
    if args.timeout_s is None and os.environ.get(COLLECTIVE_TIMEOUT_ENV):
        try:
            args.timeout_s = int(float(os.environ[COLLECTIVE_TIMEOUT_ENV]))
        except ValueError:
            p.error(f"${COLLECTIVE_TIMEOUT_ENV}={os.environ[COLLECTIVE_TIMEOUT_ENV]!r} is not a number of seconds")
        args.timeout_source = f"${COLLECTIVE_TIMEOUT_ENV}"
    if args.timeout_s is not None and args.timeout_s < 1:
        p.error("the collective timeout must be at least 1 second")
    return args


def _resources(args: argparse.Namespace) -> dict[str, float]:
    res: dict[str, float] = {"CPU": args.cpus_per_worker}
    if args.gpus_per_worker:
        res["GPU"] = args.gpus_per_worker
    if args.memory_per_worker:
        res["memory"] = args.memory_per_worker
    for item in args.worker_resource:
        name, _, amount = item.partition("=")
        if not name or not amount:
            raise SystemExit(f"--worker-resource expects NAME=AMOUNT, got {item!r}")
        res[name] = float(amount)
    return res


def failure_reason(exc: BaseException) -> str:
    """One line that names the root cause: a line about a timeout first, then
    the first line of a rank's own error (Ray Train's wrapper lines only say
    that workers failed), then the first line."""
    texts = []
    seen = set()
    node: BaseException | None = exc
    while node is not None and id(node) not in seen:
        seen.add(id(node))
        texts.append(f"{type(node).__name__}: {node}")
        failures = getattr(node, "worker_failures", None)
        if isinstance(failures, dict):
            texts.extend(f"rank {r}: {type(e).__name__}: {e}" for r, e in failures.items())
        node = node.__cause__ or node.__context__
    lines = [ln.strip() for t in texts for ln in t.splitlines() if ln.strip()]
    timeout_lines = [ln for ln in lines if re.search(r"timed out|timeout", ln, re.IGNORECASE)]
    rank_lines = [ln for ln in lines if re.match(r"rank \d+: ", ln)]
    chosen = (timeout_lines or rank_lines or lines or [type(exc).__name__])[0]
    return chosen[:500]


def marked_torch_config(backend: str, timeout_s: int | None):
    """``TorchConfig(backend, timeout_s)`` (Ray Train's default timeout when
    None) that also emits ``process_group_setup``, with the timeout the process
    group really gets, when Ray Train starts setting up the process group
    (after the worker actors exist): the moment the collective timeout starts
    to count, so a fail-fast check can leave worker start-up out of it."""
    from ray.train.torch import TorchConfig
    from ray.train.torch.config import _TorchBackend  # the backend TorchConfig uses (Ray 2.60)

    class MarkedBackend(_TorchBackend):
        def on_start(self, worker_group, backend_config):
            emit("process_group_setup", backend=backend_config.backend, timeout_s=backend_config.timeout_s)
            super().on_start(worker_group, backend_config)

    @dataclasses.dataclass
    class MarkedTorchConfig(TorchConfig):
        @property
        def backend_cls(self):
            return MarkedBackend

    return MarkedTorchConfig(backend=backend, **({} if timeout_s is None else {"timeout_s": timeout_s}))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)

    import ray
    from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    if __name__ != "__main__" and __name__ in sys.modules:
        # Ship this module's code to the workers by value, so a cluster that
        # only has Ray and torch installed can run it.
        import ray.cloudpickle

        ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])

    ray.init(address=args.ray_address, log_to_driver=True)
    config = {
        "steps": args.steps, "checkpoint_every": args.checkpoint_every, "seed": args.seed,
        "step_time_s": args.step_time_s, "global_batch": args.global_batch, "seq_len": args.seq_len,
        "vocab": args.vocab, "d_model": args.d_model, "layers": args.layers, "heads": args.heads,
        "lr": args.lr, "gpus_per_worker": args.gpus_per_worker,
    }
    use_gpu = args.gpus_per_worker > 0
    torch_config = marked_torch_config("nccl" if use_gpu else "gloo", args.timeout_s)
    trainer = TorchTrainer(
        train_loop_per_worker,
        train_loop_config=config,
        scaling_config=ScalingConfig(num_workers=args.world_size, use_gpu=use_gpu, resources_per_worker=_resources(args)),
        torch_config=torch_config,
        run_config=RunConfig(
            name=args.name,
            storage_path=args.storage_path,
            failure_config=FailureConfig(max_failures=args.max_failures),
            checkpoint_config=CheckpointConfig(num_to_keep=2),
        ),
    )
    emit("start", name=args.name, storage_path=args.storage_path, world_size=args.world_size,
         steps=args.steps, checkpoint_every=args.checkpoint_every, timeout_s=torch_config.timeout_s,
         timeout_source=args.timeout_source, max_failures=args.max_failures, use_gpu=use_gpu)
    began = time.monotonic()
    try:
        result = trainer.fit()
    except Exception as exc:  # noqa: BLE001 - every failure becomes one reason line
        reason = failure_reason(exc)
        emit("failure", reason=reason, error_type=type(exc).__name__, timeout_s=torch_config.timeout_s,
             seconds=round(time.monotonic() - began, 3))
        print(f"training failed: {reason}", file=sys.stderr, flush=True)
        return 1
    metrics = result.metrics or {}
    emit("finish", step=metrics.get("step"), loss=metrics.get("loss"),
         checkpoint=result.checkpoint.path if result.checkpoint else None,
         seconds=round(time.monotonic() - began, 3))
    if metrics.get("step") != args.steps:
        print(f"training failed: finished at step {metrics.get('step')} instead of {args.steps}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
