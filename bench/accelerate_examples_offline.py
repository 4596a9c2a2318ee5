"""Run a script with the Hugging Face Hub replaced by offline stand-ins (used by accelerate_examples.py).

    python bench/accelerate_examples_offline.py SCRIPT [ARGS...]

The stand-ins keep the shapes the scripts expect and need no network: ``datasets.load_dataset``
gives an MRPC-shaped synthetic corpus (sentence pairs whose label says which half of the
vocabulary both sentences are drawn from, so that a small model learns it within the examples'
few epochs; 4096 training pairs, an uneven validation split of 43),
``AutoTokenizer.from_pretrained`` a word-level fast tokenizer over that vocabulary,
``AutoModelForSequenceClassification.from_pretrained`` a 2-layer BERT with random weights, and
``evaluate.load`` an accuracy/F1 metric that prints what it computed (and over how many samples).
Without CUDA, DDP is built without ``device_ids`` (the fp8 benchmarks' raw-torchao baselines pass
them, and DDP refuses them for a CPU module).
"""

from __future__ import annotations

import os
import random
import runpy
import sys

WORDS = [f"w{i}" for i in range(60)]
SPECIAL = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
SIZES = {"train": 4096, "validation": 43, "test": 43}
HALF = len(WORDS) // 2


def _pairs(n: int, seed: int) -> dict[str, list]:
    rng = random.Random(seed)
    rows: dict[str, list] = {"sentence1": [], "sentence2": [], "label": [], "idx": []}
    for i in range(n):
        label = rng.random() < 0.5
        words = WORDS[:HALF] if label else WORDS[HALF:]
        first, second = rng.choices(words, k=rng.randint(5, 12)), rng.choices(words, k=rng.randint(5, 12))
        rows["sentence1"].append(" ".join(first))
        rows["sentence2"].append(" ".join(second))
        rows["label"].append(int(label))
        rows["idx"].append(i)
    return rows


def load_dataset(*_args, **_kwargs):
    import datasets

    return datasets.DatasetDict(
        {split: datasets.Dataset.from_dict(_pairs(n, seed)) for seed, (split, n) in enumerate(SIZES.items())}
    )


def tokenizer_from_pretrained(*_args, **_kwargs):
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {token: i for i, token in enumerate(SPECIAL + WORDS)}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1", special_tokens=[("[CLS]", 2), ("[SEP]", 3)]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        pad_token="[PAD]",
        unk_token="[UNK]",
        cls_token="[CLS]",
        sep_token="[SEP]",
        mask_token="[MASK]",
        model_max_length=128,
    )


def model_from_pretrained(*_args, **kwargs):
    from transformers import AutoModelForSequenceClassification, BertConfig

    config = BertConfig(
        vocab_size=len(SPECIAL) + len(WORDS),
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=128,
        max_position_embeddings=128,
        num_labels=2,
    )
    return AutoModelForSequenceClassification.from_config(config)


class AccuracyF1:
    """The two numbers GLUE/MRPC reports, with evaluate's add_batch/compute interface."""

    def __init__(self):
        self.predictions: list[int] = []
        self.references: list[int] = []

    def add_batch(self, *, predictions, references):
        self.predictions += [int(p) for p in predictions]
        self.references += [int(r) for r in references]

    def compute(self, *, predictions=None, references=None):
        if predictions is not None:
            self.add_batch(predictions=predictions, references=references)
        pairs = list(zip(self.predictions, self.references))
        self.predictions, self.references = [], []
        tp = sum(1 for p, r in pairs if p == r == 1)
        predicted, actual = sum(p for p, _ in pairs), sum(r for _, r in pairs)
        f1 = 2 * tp / (predicted + actual) if predicted + actual else 0.0
        result = {"accuracy": sum(p == r for p, r in pairs) / max(len(pairs), 1), "f1": f1}
        # Printed so that scripts which only assert on their metrics (Accelerate's fp8 benchmarks)
        # can be compared too; the sample count shows what gather_for_metrics kept.
        print(f"metric computed on rank {os.environ.get('RANK', '0')}: {result} over {len(pairs)} samples", flush=True)
        return result


def ddp_without_device_ids_on_cpu() -> None:
    """The fp8 benchmarks' raw-torchao baselines wrap the model in DDP with ``device_ids=[local
    rank]``, which DDP refuses for a CPU module; without CUDA the ids are dropped (both runs alike)."""
    import torch
    from torch.nn.parallel import DistributedDataParallel

    if torch.cuda.is_available():
        return
    original = DistributedDataParallel.__init__

    def init(self, module, *args, **kwargs):
        if all(p.device.type == "cpu" for p in module.parameters()):
            kwargs.pop("device_ids", None)
            kwargs.pop("output_device", None)
        original(self, module, *args, **kwargs)

    DistributedDataParallel.__init__ = init


def install() -> None:
    import datasets
    import evaluate
    import transformers

    datasets.load_dataset = load_dataset
    evaluate.load = lambda *a, **k: AccuracyF1()
    transformers.AutoTokenizer.from_pretrained = tokenizer_from_pretrained
    transformers.AutoModelForSequenceClassification.from_pretrained = model_from_pretrained
    ddp_without_device_ids_on_cpu()


if __name__ == "__main__":
    install()
    script, sys.argv = sys.argv[1], sys.argv[1:]
    sys.path.insert(0, str(__import__("pathlib").Path(script).parent))
    runpy.run_path(script, run_name="__main__")
