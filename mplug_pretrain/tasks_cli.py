"""CLI glue for fine-tuning and evaluation. Each task lives in its own module (command_registry.FINETUNE_TASKS,
EVAL_TASKS) and exposes ``run(cfg, ...)``; every registered task is offered."""
from __future__ import annotations

import json

from mplug_pretrain.cli_parsing import IntermixedParser
from mplug_pretrain.command_registry import EVAL_TASKS, FINETUNE_TASKS, import_task


def _load(args):
    from mplug_pretrain.config import load_config
    return load_config(args.config, args.overrides)


def _add_config(p) -> None:
    p.add_argument("--config", required=True, help="YAML run config (configs/*.yaml)")
    p.add_argument("overrides", nargs="*", metavar="key=value")


def cmd_finetune(args) -> int:
    cfg = _load(args)
    module = import_task(FINETUNE_TASKS, args.task, f"mplug finetune {args.task}")
    result = module.run(cfg, resume=args.resume)
    print(json.dumps(result.get("metrics", {}), indent=2))
    return 0


def cmd_eval(args) -> int:
    cfg = _load(args)
    module = import_task(EVAL_TASKS, args.task, f"mplug eval {args.task}")
    metrics = module.run(cfg, checkpoint=args.checkpoint, out=args.out)
    print(json.dumps(metrics, indent=2))
    return 0


def register_finetune(sub) -> None:
    tasks = FINETUNE_TASKS
    p = sub.add_parser("finetune", help="fine-tune a pretrained model: " + " | ".join(tasks))
    kinds = p.add_subparsers(dest="task", required=True, metavar="|".join(sorted(tasks)),
                             parser_class=IntermixedParser)
    for task in sorted(tasks):
        q = kinds.add_parser(task, help=f"fine-tune for {task}")
        _add_config(q)
        q.add_argument("--resume", default=None, help="latest | auto | a checkpoint tag")
        q.set_defaults(func=cmd_finetune)


def register_eval(sub) -> None:
    tasks = EVAL_TASKS
    p = sub.add_parser("eval", help="evaluate a checkpoint: " + " | ".join(tasks))
    kinds = p.add_subparsers(dest="task", required=True, metavar="|".join(sorted(tasks)),
                             parser_class=IntermixedParser)
    for task in sorted(tasks):
        q = kinds.add_parser(task, help=f"evaluate {task}")
        _add_config(q)
        q.add_argument("--checkpoint", required=True, help="a model folder (save_pretrained / mplug export)")
        q.add_argument("--out", default=None, help="metrics JSON (default: eval.output or the run folder)")
        q.set_defaults(func=cmd_eval)
