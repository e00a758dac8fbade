"""CLI glue for fine-tuning, evaluation and prediction. Each task lives in its own module and
exposes ``run(cfg, ...)``; a task is offered only once its module has landed."""
from __future__ import annotations

import importlib
import importlib.util
import json

from mplug_pretrain.cli_parsing import IntermixedParser

FINETUNE_TASKS = {
    "caption": "mplug_pretrain.train.caption_task",
    "vqa": "mplug_pretrain.train.vqa_task",
}
EVAL_TASKS = {
    "caption": "mplug_pretrain.eval.caption_task",
    "vqa": "mplug_pretrain.eval.vqa_task",
    "retrieval": "mplug_pretrain.eval.retrieval_task",
    "video-retrieval": "mplug_pretrain.eval.video_retrieval_task",
    "video-qa": "mplug_pretrain.eval.video_qa_task",
    "video-caption": "mplug_pretrain.eval.video_caption_task",
}


def _available(tasks: dict) -> dict:
    return {name: mod for name, mod in tasks.items() if importlib.util.find_spec(mod) is not None}


def _load(args):
    from mplug_pretrain.config import load_config
    return load_config(args.config, args.overrides)


def _add_config(p) -> None:
    p.add_argument("--config", required=True, help="YAML run config (configs/*.yaml)")
    p.add_argument("overrides", nargs="*", metavar="key=value")


def cmd_finetune(args) -> int:
    cfg = _load(args)
    module = importlib.import_module(FINETUNE_TASKS[args.task])
    result = module.run(cfg, resume=args.resume)
    print(json.dumps(result.get("metrics", {}), indent=2))
    return 0


def cmd_eval(args) -> int:
    cfg = _load(args)
    module = importlib.import_module(EVAL_TASKS[args.task])
    metrics = module.run(cfg, checkpoint=args.checkpoint, out=args.out)
    print(json.dumps(metrics, indent=2))
    return 0


def register_finetune(sub) -> None:
    tasks = _available(FINETUNE_TASKS)
    if not tasks:
        return
    p = sub.add_parser("finetune", help="fine-tune a pretrained model: " + " | ".join(tasks))
    kinds = p.add_subparsers(dest="task", required=True, metavar="|".join(sorted(tasks)),
                             parser_class=IntermixedParser)
    for task in sorted(tasks):
        q = kinds.add_parser(task, help=f"fine-tune for {task}")
        _add_config(q)
        q.add_argument("--resume", default=None, help="latest | auto | a checkpoint tag")
        q.set_defaults(func=cmd_finetune)


def register_eval(sub) -> None:
    tasks = _available(EVAL_TASKS)
    if not tasks:
        return
    p = sub.add_parser("eval", help="evaluate a checkpoint: " + " | ".join(tasks))
    kinds = p.add_subparsers(dest="task", required=True, metavar="|".join(sorted(tasks)),
                             parser_class=IntermixedParser)
    for task in sorted(tasks):
        q = kinds.add_parser(task, help=f"evaluate {task}")
        _add_config(q)
        q.add_argument("--checkpoint", required=True, help="a model folder (save_pretrained / mplug export)")
        q.add_argument("--out", default=None, help="metrics JSON (default: eval.output or the run folder)")
        q.set_defaults(func=cmd_eval)


def register_caption(sub) -> None:
    spec = "mplug_pretrain.eval.predict_captions"
    if importlib.util.find_spec(spec) is None:
        return
    module = importlib.import_module(spec)
    module.register(sub)


def register_cache_features(sub) -> None:
    spec = "mplug_pretrain.train.feature_cache"
    if importlib.util.find_spec(spec) is None:
        return
    module = importlib.import_module(spec)
    if hasattr(module, "register"):
        module.register(sub)
