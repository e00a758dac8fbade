"""``mplug finetune <task> --config FILE`` and ``mplug eval <task> --config FILE --checkpoint DIR``: one
sub-command per task of the registry (FINETUNE_TASKS, EVAL_TASKS); each task module exposes ``run``."""
from __future__ import annotations

import json
import os
import sys

from mplug_pretrain.cli.parsing import IntermixedParser, add_config_args, load_config_from_args
from mplug_pretrain.cli.registry import EVAL_TASKS, FINETUNE_TASKS
from mplug_pretrain.config import use_folder_tokenizer
from mplug_pretrain.utils.process_group import is_distributed, rank


def register_finetune(sub) -> None:
    kinds = _task_parsers(sub, "finetune", "fine-tune a pretrained model", FINETUNE_TASKS)
    for q in kinds.values():
        q.add_argument("--resume", default=None, help="latest | auto | a checkpoint tag")
        q.set_defaults(func=run_finetune)


def register_eval(sub) -> None:
    kinds = _task_parsers(sub, "eval", "evaluate a checkpoint", EVAL_TASKS)
    for q in kinds.values():
        q.add_argument("--checkpoint", required=True, help="a model folder (save_pretrained / mplug export)")
        q.add_argument("--out", default=None, help="metrics JSON (default: eval.output or the run folder)")
        q.set_defaults(func=run_eval)


def _task_parsers(sub, command: str, help_text: str, tasks: dict) -> dict:
    p = sub.add_parser(command, help=f"{help_text}: " + " | ".join(tasks))
    kinds = p.add_subparsers(dest="task", required=True, metavar="|".join(sorted(tasks)),
                             parser_class=IntermixedParser)
    parsers = {}
    for task in sorted(tasks):
        parsers[task] = kinds.add_parser(task, help=f"{command} {task}")
        add_config_args(parsers[task])
    return parsers


def run_finetune(args) -> int:
    cfg = load_config_from_args(args)
    result = FINETUNE_TASKS[args.task]().run(cfg, resume=args.resume)
    print(json.dumps(result.get("metrics", {}), indent=2))
    if result.get("model_dir") and first_rank():  # the folder `mplug eval` / `mplug caption` take
        print(f"[finetune] final model: {result['model_dir']}", file=sys.stderr, flush=True)
    return 0


def run_eval(args) -> int:
    cfg = load_config_from_args(args, check_paths="eval")  # the training shards need not exist to evaluate
    use_folder_tokenizer(cfg, args.checkpoint)
    from mplug_pretrain.tasks.evaluation import metrics_path
    out = metrics_path(cfg, args.task, args.out, args.checkpoint)
    metrics = EVAL_TASKS[args.task]().run(cfg, checkpoint=args.checkpoint, out=out)
    if first_rank():  # under torchrun every rank returns the metrics; one prints them
        print(json.dumps(metrics, indent=2))
        print(f"[eval] metrics written to {out}", file=sys.stderr, flush=True)
    return 0


def first_rank() -> bool:
    """Rank 0 of the job: of the process group while it exists, else of the launcher's RANK."""
    return rank() == 0 if is_distributed() else os.environ.get("RANK", "0") == "0"
