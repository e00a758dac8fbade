"""One rank of the resharding check (tests/train/test_reshard.py), started by tests/fork_ranks.py on gloo:
build the engine of the tag's run config at ZeRO stage STAGE on this world size, ``load_resharded`` the tag,
then read back what the engine holds through DeepSpeed's own accessors (safe_get_full_fp32_param /
safe_get_full_optimizer_state, AdamW's step of each group, the momentum parameters gathered under ZeRO-3, the
buffers) into OUT/engine_state.pt (rank 0), save the engine again (OUT/resaved/<tag>), and take one real
training step on the demo shards (OUT/step.json: AdamW's step after it, the losses).
    python tests/fork_ranks.py N tests/train/reshard_worker.py STAGE CKPT_DIR TAG \
        SAVED_WORLD SHARDS OUT
"""
import json
import os
import sys

import torch


def adamw(engine, stage: int) -> torch.optim.Optimizer:
    """The torch AdamW itself (ZeRO 1-3 wrap it)."""
    return engine.optimizer if stage == 0 else engine.optimizer.optimizer


def engine_state(engine, stage: int) -> dict:
    """Full values from the live engine (collective: every rank calls it)."""
    import deepspeed
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state
    params = dict(engine.module.named_parameters())
    trainable = {n: p for n, p in params.items() if p.requires_grad}
    frozen = {n: p for n, p in params.items() if not p.requires_grad}
    out = {"masters": {}, "exp_avg": {}, "exp_avg_sq": {}}
    for name, p in trainable.items():
        shape = p.ds_shape if stage == 3 else p.shape
        if stage == 0:
            out["masters"][name] = p.detach().clone()
            for key in ("exp_avg", "exp_avg_sq"):
                if key in engine.optimizer.state.get(p, {}):
                    out[key][name] = engine.optimizer.state[p][key].clone()
            continue
        out["masters"][name] = safe_get_full_fp32_param(p).detach().clone().reshape(shape)
        for key in ("exp_avg", "exp_avg_sq"):
            out[key][name] = safe_get_full_optimizer_state(p, key).detach().clone().reshape(shape)
    with deepspeed.zero.GatheredParameters(list(frozen.values())) if stage == 3 else torch.no_grad():
        out["frozen"] = {n: p.detach().clone() for n, p in frozen.items()}
    out["buffers"] = {n: b.detach().clone() for n, b in engine.module.named_buffers()}
    out["steps"] = sorted({int(s["step"]) for s in adamw(engine, stage).state.values()})
    return out


def main(stage: int, ckpt_dir: str, tag: str, saved_world: int, shards: str, out_dir: str) -> None:
    from mplug_pretrain.config import load_config
    from mplug_pretrain.data.reading.loader_spec import LoaderSpec
    from mplug_pretrain.tasks.pretrain.train import build_model, build_train_loader
    from mplug_pretrain.train.checkpoint import TrainerState, save_checkpoint
    from mplug_pretrain.train.distributed import init_distributed
    from mplug_pretrain.train.engine import after_optimizer_step, build_engine
    from mplug_pretrain.train.loop import TrainTask, _micro_step, bare_run
    from mplug_pretrain.train.reshard import load_resharded

    info = init_distributed("gloo", 5)
    rank, world = info.rank, info.world_size
    cfg = load_config(os.path.join(ckpt_dir, tag, "config.yaml"), [
        f"distributed.zero_stage={stage}", f"data.train_shards={shards}", "data.num_workers=0"],
        check_paths=False)
    torch.manual_seed(1000 + rank)  # weights unlike the checkpoint's: the load must replace every one
    engine, optimizer, ds_config = build_engine(build_model(cfg), cfg, world)
    assert ds_config["zero_optimization"]["stage"] == stage, ds_config["zero_optimization"]
    load_resharded(engine, ckpt_dir, tag, rank, stage, saved_world)

    state = engine_state(engine, stage)
    if rank == 0:
        torch.save(state, os.path.join(out_dir, "engine_state.pt"))
    step = state["steps"][0] if state["steps"] else 0
    save_checkpoint(engine, os.path.join(out_dir, "resaved"), TrainerState(global_step=step), rank,
                    keep_last=1, world_size=world)

    # training goes on from the loaded state: one real optimizer step
    def losses(module, batch, _state):
        return module(batch, alpha=0.4)

    task = TrainTask("pretrain", build_model, build_train_loader, losses)
    run = bare_run(cfg, task, engine, optimizer, rank, world)
    run.state = TrainerState(global_step=step)
    loader = build_train_loader(cfg, LoaderSpec(shards, cfg.data.batch_size, 0, rank=rank, world_size=world))
    run.image_normalize = loader.image_normalize
    out = _micro_step(run, next(iter(loader)))
    assert out is not None and out[1], "a finite micro-step at an optimizer-step boundary"
    after_optimizer_step(engine, stage)
    steps = sorted({int(s["step"]) for s in adamw(engine, stage).state.values()})
    if rank == 0:
        with open(os.path.join(out_dir, "step.json"), "w") as f:
            json.dump({"steps_after": steps, "losses": {k: float(v) for k, v in run.losses_accum.items()}}, f)
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5], sys.argv[6])
