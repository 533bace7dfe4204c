"""fusedlm distill: a smaller student trained from a pretrained masked-LM teacher, as
DistilBERT was (fusedlm.models.distillation): started from every other layer of the
teacher, trained on DistilBERT's loss with the teacher's tokenizer and pretrain's data,
checkpoints, --resume, metrics, loss curve and torchrun support."""
from __future__ import annotations

import argparse
import dataclasses

import torch

from . import loading, pretrain, registry
from .common import load_model, positive_int
from .errors import UsageError

# Settings a resumed run takes from its checkpoint; None: no default.
FIXED = {"teacher": None, "layers": None, "corpus": None, "seq_len": 128, "grad_accum": 1,
         "lr": None, "warmup": None, "clip": 1.0, "dtype": "fp32", "seed": 0,
         "temperature": 2.0, "alpha_ce": 5.0, "alpha_mlm": 2.0, "alpha_cos": 1.0,
         "deterministic": False}
LR = 5e-4  # DistilBERT's peak learning rate

HELP = "train a smaller student from a pretrained BERT or RoBERTa (DistilBERT's recipe)"
DESCRIPTION = """Distils a pretrained masked-LM teacher (a BERT or RoBERTa folder) into a
student of --layers layers (a DistilBERT for a BERT teacher, a smaller RoBERTa for a
RoBERTa one), initialised from teacher layers spread evenly from the first to the last,
with its embeddings and masked-LM head. The loss is DistilBERT's: --alpha-ce times the
soft-target loss at --temperature, --alpha-mlm times the masked-LM loss and --alpha-cos
times the cosine loss between the two models' last hidden states; each term is logged in
metrics.jsonl. The corpus is read and masked as pretrain's, with the teacher's tokenizer.
--out receives the student, loadable by transformers."""


def add_arguments(p) -> None:
    p.add_argument("--teacher", metavar="DIR",
                   help="the teacher: a BertForMaskedLM / BertForPreTraining or RobertaForMaskedLM "
                        "folder with its tokenizer.json")
    p.add_argument("--layers", type=positive_int,
                   help="the student's layers (default half the teacher's)")
    pretrain.add_training_arguments(p, lr_default=f"{LR:g}",
                                    out_help="the folder the student is written to (needed)")
    p.add_argument("--temperature", type=float, help="of the soft targets (default 2.0)")
    p.add_argument("--alpha-ce", type=float, help="weight of the soft-target loss (default 5.0)")
    p.add_argument("--alpha-mlm", type=float, help="weight of the masked-LM loss (default 2.0)")
    p.add_argument("--alpha-cos", type=float, help="weight of the cosine loss (default 1.0)")


def run(args: argparse.Namespace) -> int:
    processes, device = pretrain.start_processes(args)
    if args.resume:
        resumed, settings, state = pretrain.resumed_settings(args, processes, FIXED)
    else:
        if args.teacher is None:
            raise UsageError("--teacher is needed: the folder of the model to distil")
        if args.out is None:
            raise UsageError("--out is needed: the folder the student is written to")
        resumed, state = None, None
        settings = pretrain.new_settings(args, processes, FIXED, LR, args.out)
        if not settings["temperature"] > 0:
            raise UsageError(f"--temperature must be positive, got {settings['temperature']}")
        for name in ("alpha_ce", "alpha_mlm", "alpha_cos"):
            if settings[name] < 0:
                raise UsageError(f"--{name.replace('_', '-')} must not be negative, got "
                                 f"{settings[name]}")
    # On the CPU until pretrain's loop moves the student and it to the device together.
    teacher_spec, teacher, _ = load_model(settings["teacher"], "fill-mask", torch.device("cpu"))
    if teacher_spec.name not in ("bert", "roberta"):
        raise UsageError(f"--teacher {settings['teacher']}: distill takes a bert or roberta "
                         f"teacher, not {teacher_spec.name}")
    settings["layers"] = settings["layers"] or max(1, teacher.config.num_hidden_layers // 2)
    if settings["layers"] > teacher.config.num_hidden_layers:
        raise UsageError(f"--layers {settings['layers']}: the teacher has only "
                         f"{teacher.config.num_hidden_layers}")
    # What pretrain's loop reads: the teacher's tokenizer, no model-specific options.
    settings.update(tokenizer=settings["teacher"], vocab_size=None, dropout=None,
                    embedding_size=None, fsdp=False)
    spec = _student_spec(teacher_spec, teacher, settings)
    return pretrain.train(args, processes, device, resumed, settings, state, spec, None)


def _student_spec(teacher_spec: registry.ModelSpec, teacher, settings: dict) -> registry.ModelSpec:
    """pretrain's spec for the teacher's family, training a Distiller of the student instead:
    the teacher's data and batches, DistilBERT's loss, the student saved and exported."""
    from ..models import Distiller, student_from_teacher

    options = {name: settings[name] for name in ("temperature", "alpha_ce", "alpha_mlm", "alpha_cos")}

    def build(size, tokenizer, dropout, embedding_size):
        return Distiller(student_from_teacher(teacher, settings["layers"]), teacher, **options)

    def resume(folder):
        student_spec = registry.by_model_type("distilbert" if teacher_spec.name == "bert"
                                              else teacher_spec.name)
        student = loading.load(folder, student_spec.heads["pretrain"], flag="--resume").model
        return Distiller(student, teacher, **options)

    def loss(model, inputs, generator):
        return model(inputs["input_ids"], inputs["labels"])

    return dataclasses.replace(
        teacher_spec, name=f"distilled {teacher_spec.name}", build=build, loss=loss,
        resume=resume, export=lambda model: model.student, layers=None)
