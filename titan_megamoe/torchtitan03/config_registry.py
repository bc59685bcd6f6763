"""Training configs for TorchTitan 0.3.0: qwen3 MoE models, stock and with mega_moe.

    torchrun ... -m torchtitan.train --module titan_megamoe.torchtitan03.config_registry \\
        --config qwen3_30b_a3b_4l_mega_moe

(``scripts/run_train_torchtitan03.sh`` launches them as ``scripts/run_train.sh`` does the
0.2.2 TOMLs in ``train_configs/``, with the same settings.) One function per model and
variant (``MODELS`` x ``VARIANTS``):

- ``*_stock``: stock TorchTitan 0.3.0;
- ``*_mega_moe``: the routed experts run by the operator (``MegaMoEConverter``);
- ``*_fp8``: torchao's ``Float8GroupedExpertsConverter`` then ``MegaMoEConverter``, which
  runs it as blockwise fp8 (``precision = "auto"``).

Every config trains on the shipped tokenizer and dataset (``titan_megamoe.data``),
logs every step and seeds its RNGs. ``scripts/ab_train_torchtitan03.sh`` trains one of
them as written and as stock.
"""

from dataclasses import dataclass

from torchtitan.components.loss import ChunkedLossWrapper, CrossEntropyLoss
from torchtitan.components.metrics import MetricsProcessor
from torchtitan.components.optimizer import default_adamw, LRSchedulersContainer
from torchtitan.components.quantization import Float8GroupedExpertsConverter
from torchtitan.config import ParallelismConfig, TrainingConfig
from torchtitan.config.configs import DebugConfig
from torchtitan.distributed.activation_checkpoint import FullAC, SelectiveAC
from torchtitan.hf_datasets.text_datasets import HuggingFaceTextDataLoader
from torchtitan.models.common.config_utils import decoder_vocab_size
from torchtitan.models.qwen3 import model_registry
from torchtitan.trainer import Trainer

from titan_megamoe import data
from titan_megamoe.torchtitan03 import MegaMoEConverter

SEED = 42


@dataclass(frozen=True)
class Model:
    """One model's training setup."""

    flavor: str
    expert_parallel_degree: int
    lr: float
    local_batch_size: int
    seq_len: int
    steps: int
    full_ac: bool
    """Full activation checkpointing (else selective)."""
    save_gemm1: bool = False
    """The mega_moe and fp8 variants keep GEMM1's pre-activations (under full AC only the
    layer being recomputed holds them, and the backward is spared a quarter of its GEMM
    work)."""


MODELS: dict[str, Model] = {
    # Qwen3 debugmodel_moe (8 layers, 64 experts, top-8): a quick end-to-end check on 2+ GPUs.
    "debug_moe": Model("debugmodel_moe", 2, lr=8e-4, local_batch_size=4, seq_len=2048, steps=50, full_ac=False),
    # Qwen3-30B-A3B (48 layers, 128 experts, top-8) and Qwen3-235B-A22B on one 8-GPU node.
    "qwen3_30b_a3b": Model("30B-A3B", 8, lr=3e-4, local_batch_size=1, seq_len=16384, steps=20, full_ac=True),
    "qwen3_235b_a22b": Model("235B-A22B", 8, lr=3e-4, local_batch_size=1, seq_len=16384, steps=20, full_ac=True),
    # Their layer shapes at a few layers (titan_megamoe.torchtitan03.flavors): training A/Bs on 2 GPUs.
    "qwen3_30b_a3b_4l": Model("30B-A3B-4L", 2, lr=3e-4, local_batch_size=1, seq_len=16384, steps=20, full_ac=True,
                              save_gemm1=True),
    "qwen3_30b_a3b_12l": Model("30B-A3B-12L", 2, lr=3e-4, local_batch_size=1, seq_len=16384, steps=20, full_ac=True,
                               save_gemm1=True),
    "qwen3_235b_a22b_2l": Model("235B-A22B-2L", 2, lr=3e-4, local_batch_size=1, seq_len=16384, steps=20,
                                full_ac=True),
}

VARIANTS = ("stock", "mega_moe", "fp8")


def trainer_config(model: str, variant: str) -> Trainer.Config:
    """The Trainer.Config of ``MODELS[model]`` in ``variant`` (one of ``VARIANTS``)."""
    setup = MODELS[model]
    converters = {
        "stock": [],
        "mega_moe": [MegaMoEConverter.Config(save_gemm1=setup.save_gemm1)],
        "fp8": [Float8GroupedExpertsConverter.Config(), MegaMoEConverter.Config(save_gemm1=setup.save_gemm1)],
    }[variant]
    model_spec = model_registry(setup.flavor, converters=converters)
    return Trainer.Config(
        model_spec=model_spec,
        loss=ChunkedLossWrapper.Config(
            loss_fn=CrossEntropyLoss.Config(global_vocab_size=decoder_vocab_size(model_spec)),
        ),
        hf_assets_path=data.TOKENIZER_DIR,
        dump_folder=f"./outputs/{model}_{variant}",
        metrics=MetricsProcessor.Config(log_freq=1),
        dataloader=HuggingFaceTextDataLoader.Config(dataset=data.DATASET_NAME),
        optimizer=default_adamw(lr=setup.lr),
        lr_scheduler=LRSchedulersContainer.Config(warmup_steps=2),
        training=TrainingConfig(
            local_batch_size=setup.local_batch_size,
            seq_len=setup.seq_len,
            steps=setup.steps,
            # Expert parallelism synchronises with the host (stock's all-to-all splits, and
            # the operator's buffer growth): no CUDA graphs.
            disable_cuda_graphs=True,
        ),
        parallelism=ParallelismConfig(data_parallel_shard_degree=-1,
                                      expert_parallel_degree=setup.expert_parallel_degree),
        activation_checkpoint=FullAC.Config() if setup.full_ac else SelectiveAC.Config(),
        debug=DebugConfig(seed=SEED),
    )


def debug_moe_stock() -> Trainer.Config:
    return trainer_config("debug_moe", "stock")


def debug_moe_mega_moe() -> Trainer.Config:
    return trainer_config("debug_moe", "mega_moe")


def debug_moe_fp8() -> Trainer.Config:
    return trainer_config("debug_moe", "fp8")


def qwen3_30b_a3b_stock() -> Trainer.Config:
    return trainer_config("qwen3_30b_a3b", "stock")


def qwen3_30b_a3b_mega_moe() -> Trainer.Config:
    return trainer_config("qwen3_30b_a3b", "mega_moe")


def qwen3_30b_a3b_fp8() -> Trainer.Config:
    return trainer_config("qwen3_30b_a3b", "fp8")


def qwen3_235b_a22b_stock() -> Trainer.Config:
    return trainer_config("qwen3_235b_a22b", "stock")


def qwen3_235b_a22b_mega_moe() -> Trainer.Config:
    return trainer_config("qwen3_235b_a22b", "mega_moe")


def qwen3_235b_a22b_fp8() -> Trainer.Config:
    return trainer_config("qwen3_235b_a22b", "fp8")


def qwen3_30b_a3b_4l_stock() -> Trainer.Config:
    return trainer_config("qwen3_30b_a3b_4l", "stock")


def qwen3_30b_a3b_4l_mega_moe() -> Trainer.Config:
    return trainer_config("qwen3_30b_a3b_4l", "mega_moe")


def qwen3_30b_a3b_4l_fp8() -> Trainer.Config:
    return trainer_config("qwen3_30b_a3b_4l", "fp8")


def qwen3_30b_a3b_12l_stock() -> Trainer.Config:
    return trainer_config("qwen3_30b_a3b_12l", "stock")


def qwen3_30b_a3b_12l_mega_moe() -> Trainer.Config:
    return trainer_config("qwen3_30b_a3b_12l", "mega_moe")


def qwen3_30b_a3b_12l_fp8() -> Trainer.Config:
    return trainer_config("qwen3_30b_a3b_12l", "fp8")


def qwen3_235b_a22b_2l_stock() -> Trainer.Config:
    return trainer_config("qwen3_235b_a22b_2l", "stock")


def qwen3_235b_a22b_2l_mega_moe() -> Trainer.Config:
    return trainer_config("qwen3_235b_a22b_2l", "mega_moe")


def qwen3_235b_a22b_2l_fp8() -> Trainer.Config:
    return trainer_config("qwen3_235b_a22b_2l", "fp8")
