"""The captioning part of `mplug demo`: fine-tune the pretrained tiny model on the synthetic caption shards
with cross-entropy, then a short SCST (configs/caption_demo.yaml: both stages on cached features of the
frozen ViT), and report held-out CIDEr-D on the synthetic validation scenes after each.

    caption_demo(pretrained_dir, shards, run_root, seed) -> {"caption_cider": beam search after SCST,
        "caption_cider_xe": beam search after cross-entropy only, "caption_sample_cider" / "_xe": the mean
        CIDEr-D of sampled captions (what SCST maximises) after each, "caption_model_dir": the final model}
CIDEr-D is on the raw pycocoevalcap scale (x100 gives the papers' numbers), computed by our CIDEr-D (equal
to pycocoevalcap's Cider on the same words) on lower-cased, punctuation-free words: no Java needed.
About 9 minutes on 2 CPU cores (fp32, one process).
"""
from __future__ import annotations

import dataclasses

from mplug_pretrain.config import load_config
from mplug_pretrain.utils.resources import config_file

DEMO_CONFIG = config_file("caption_demo.yaml")
QUICK_STEPS = {"xe": 40, "scst": 6}  # `mplug demo --quick`: steps per stage name


def caption_demo(pretrained_dir: str, shards: dict, run_root: str, quick: bool = False, seed: int = 0,
                 overrides: tuple[str, ...] = ()) -> dict:
    """``shards``: ``demo.shards.ensure_demo_shards`` output (caption_train, caption_val); ``quick``: the
    stages' steps from ``QUICK_STEPS``; ``overrides``: extra ``key=value`` config overrides."""
    from mplug_pretrain.tasks.caption.finetune import run
    cfg = load_config(DEMO_CONFIG, [f"init_from={pretrained_dir}", f"caption.train_shards={shards['caption_train']}",
                                    f"caption.val_shards={shards['caption_val']}", f"run.output_dir={run_root}",
                                    f"data.tokenizer={shards['tokenizer']}",
                                    "run.name=caption", f"run.seed={seed}", "run.overwrite=true", *overrides])
    if quick:
        cfg.caption.stages = [dataclasses.replace(s, steps=QUICK_STEPS.get(s.name, s.steps)) for s in cfg.caption.stages]
    result = run(cfg)
    cider = {s["stage"]: s for s in result["stages"]}
    return {"caption_cider": cider["scst"]["cider_d"], "caption_cider_xe": cider["xe"]["cider_d"],
            "caption_sample_cider": cider["scst"]["sample_cider_d"],
            "caption_sample_cider_xe": cider["xe"]["sample_cider_d"], "caption_model_dir": result["model_dir"]}
