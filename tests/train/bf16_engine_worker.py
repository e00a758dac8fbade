"""One rank of the bf16 engine check (tests/train/test_bf16_engine.py), started by tests/fork_ranks.py with
2 ranks on gloo: real DeepSpeed in bf16 (distributed.precision=bf16), the loop's own ``_micro_step`` and
``after_optimizer_step``. Records, for the test to judge against independent computations:
- momentum: the momentum parameters after N steps, and an fp32 EMA recomputed here step by step from the
  online fp32 masters (DeepSpeed's safe_get_full_fp32_param) at m = model.heads.momentum;
- dtypes seen by forward hooks (every LayerNorm, the ITM head, ITC similarities, the losses);
- export: save_final_model's folder against the fp32 masters;
- a NaN batch on rank 1 only: skipped on both ranks, queues unchanged, counted;
- the ITC temperature's master pushed out of range, then clamped by after_optimizer_step.
    python tests/fork_ranks.py 2 tests/train/bf16_engine_worker.py STAGE OUT_DIR SHARDS
"""
import json
import os
import sys

import torch


def main(stage: int, out_dir: str, shards: str, tokenizer: str, steps: int = 4, nan_at: int = 2) -> None:
    import deepspeed
    from deepspeed.utils import safe_get_full_fp32_param, safe_set_full_fp32_param
    from safetensors.torch import load_file

    from mplug_pretrain.config import load_config
    from mplug_pretrain.data.reading.loader_spec import LoaderSpec
    from mplug_pretrain.tasks.pretrain.train import build_model, build_train_loader
    from mplug_pretrain.train.distributed import init_distributed
    from mplug_pretrain.train.engine import after_optimizer_step, build_engine, save_final_model
    from mplug_pretrain.train.loop import TrainTask, _micro_step, bare_run

    info = init_distributed("gloo", 5)
    rank, world = info.rank, info.world_size
    from mplug_pretrain.demo.vocab import vocab_size
    # the demo shards' own 268-word vocabulary: BERT's 30,522 rows would be most of a tiny bf16 step
    cfg = load_config(None, ["model.preset=tiny", f"data.train_shards={shards}", "data.batch_size=4",
                             f"data.tokenizer={tokenizer}", f"model.text.vocab_size={vocab_size(tokenizer)}",
                             "data.num_workers=0", "model.heads.queue_size=32", "model.heads.momentum=0.995",
                             "optim.warmup_steps=1", "optim.lr_rest=1e-3", "optim.lr_vision=1e-3",
                             "distributed.precision=bf16", f"distributed.zero_stage={stage}"])
    torch.manual_seed(0)
    model = build_model(cfg)
    pairs = model.momentum_pairs()
    online_names = [[n for n, _ in online.named_parameters()] for online, _ in pairs]
    reference = [[p.detach().clone().float() for p in momentum.parameters()] for _, momentum in pairs]
    engine, optimizer, _ = build_engine(model, cfg, world)
    module = engine.module
    m = cfg.model.heads.momentum

    dtypes: dict[str, set] = {}

    def record(name):
        def hook(_module, _inputs, output):
            dtypes.setdefault(name, set()).add(str(output.dtype))
        return hook

    for name, sub in module.named_modules():
        if isinstance(sub, torch.nn.LayerNorm):
            sub.register_forward_hook(record("layer_norm"))
    module.itm_head.register_forward_hook(record("itm_logits"))
    similarities = module.itc.similarities

    def recorded_similarities(a, b):
        out = similarities(a, b)
        dtypes.setdefault("itc_logits", set()).add(str(out.dtype))
        return out
    module.itc.similarities = recorded_similarities
    matmul_dtypes = set()

    def record_matmul(_module, _inputs, output):
        matmul_dtypes.add(str(output.dtype))
    module.text_encoder.layers[0].attn.query.register_forward_hook(record_matmul)

    def losses(mod, batch, state):  # the pretraining task's, with the dtypes of what it returns recorded
        out = mod(batch, alpha=0.4)
        for value in out.values():
            dtypes.setdefault("loss", set()).add(str(value.dtype))
        return out

    task = TrainTask("pretrain", build_model, build_train_loader, losses)
    run = bare_run(cfg, task, engine, optimizer, rank, world)
    shard_loader = build_train_loader(cfg, LoaderSpec(shards, 4, 0, rank=rank, world_size=world))
    run.image_normalize = shard_loader.image_normalize  # its uint8 images are normalised in _micro_step
    loader = iter(shard_loader)
    result = {"stage": stage, "rank": rank}

    def queue_state():
        return [module.itc.image_queue.clone(), module.itc.text_queue.clone(), module.itc.idx_queue.clone(),
                module.itc.queue_ptr.clone(), module.itc.queue_count.clone()]

    def masters():
        # every rank takes part (an all-reduce / all-gather per parameter)
        return [[safe_get_full_fp32_param(p).detach().clone().float() for p in online.parameters()]
                for online, _ in pairs]

    done = 0
    while done < steps:
        batch = next(loader)
        if done == nan_at and "nan_checked" not in result:
            before = queue_state()
            if rank == 1:  # a NaN needs float pixels: normalised here, so _micro_step passes them on as they are
                batch["image"] = shard_loader.image_normalize(batch["image"])
                batch["image"][0] = float("nan")
            skipped_before = run.state.nonfinite_skipped
            out = _micro_step(run, batch)
            after = queue_state()
            result["nan_checked"] = True
            result["nan_step_skipped"] = out is None
            result["nan_counted"] = run.state.nonfinite_skipped - skipped_before
            result["queues_unchanged"] = all(torch.equal(a, b) for a, b in zip(before, after))
            continue
        count_before = int(module.itc.queue_count)
        out = _micro_step(run, batch)
        assert out is not None and out[1], "a finite micro-step that is an optimizer-step boundary"
        result.setdefault("queue_grew", []).append(int(module.itc.queue_count) - count_before)
        after_optimizer_step(engine, stage)
        run.state.global_step += 1
        run.losses_accum = {}
        run.micro = 0
        done += 1
        for refs, master in zip(reference, masters()):  # the independent EMA, from the masters of this step
            for r, w in zip(refs, master):
                r.mul_(m).add_(w, alpha=1.0 - m)

    # the momentum parameters: full values (ZeRO-3: gathered)
    momentum_params = [list(momentum.parameters()) for _, momentum in pairs]
    flat = [p for ps in momentum_params for p in ps]
    gather = deepspeed.zero.GatheredParameters(flat) if stage == 3 else torch.no_grad()
    with gather:
        got = [[p.detach().clone() for p in ps] for ps in momentum_params]
    worst, dtype_set = 0.0, set()
    for refs, values in zip(reference, got):
        for r, v in zip(refs, values):
            dtype_set.add(str(v.dtype))
            worst = max(worst, float((v.float() - r).abs().max() / r.abs().max().clamp(min=1e-12)))
    result["momentum_dtypes"] = sorted(dtype_set)
    result["momentum_max_rel_diff"] = worst
    result["queue_dtype"] = str(module.itc.image_queue.dtype)

    # export equals the fp32 masters
    final_masters = masters()
    folder = os.path.join(out_dir, f"model_z{stage}")
    save_final_model(engine, folder, stage, rank)
    if rank == 0:
        saved = load_file(os.path.join(folder, "model.safetensors"))
        result["export_dtypes"] = sorted({str(v.dtype) for v in saved.values() if v.is_floating_point()})
        diffs = []
        for (online, _), names, values in zip(pairs, online_names, final_masters):
            prefix = next(n for n, mod in module.named_modules() if mod is online)
            for name, value in zip(names, values):
                key = f"{prefix}.{name}"
                if key in saved:
                    diffs.append(float((saved[key] - value).abs().max()))
        result["export_compared"] = len(diffs)
        result["export_max_abs_diff"] = max(diffs)
        momentum_prefixes = [next(n for n, mod in module.named_modules() if mod is mom) for _, mom in pairs]
        mdiffs = []
        for prefix, names, refs in zip(momentum_prefixes, online_names, reference):
            for name, r in zip(names, refs):
                mdiffs.append(float((saved[f"{prefix}.{name}"] - r).abs().max()))
        result["export_momentum_max_abs_diff"] = max(mdiffs)

    # the temperature's master pushed above its range is clamped after the step
    temp = module.itc.temp
    if stage == 3:  # DeepSpeed 0.19.8's safe_set_full_fp32_param mis-slices a 1-element parameter on 2 ranks
        from deepspeed.utils import safe_get_local_fp32_param, safe_set_local_fp32_param
        safe_set_local_fp32_param(temp, torch.full_like(safe_get_local_fp32_param(temp), 0.9))
    else:
        safe_set_full_fp32_param(temp, torch.full_like(safe_get_full_fp32_param(temp), 0.9))
    result["temp_master_before_clamp"] = float(safe_get_full_fp32_param(temp).max())
    after_optimizer_step(engine, stage)
    result["temp_master_after_clamp"] = float(safe_get_full_fp32_param(temp).max())

    result["dtypes"] = {k: sorted(v) for k, v in dtypes.items()}
    result["matmul_dtypes"] = sorted(matmul_dtypes)
    result["autocast_outside"] = torch.is_autocast_enabled("cpu")
    with open(os.path.join(out_dir, f"result_z{stage}_rank{rank}.json"), "w") as f:
        json.dump(result, f)
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4])
