"""Accelerate's ``ParallelismConfig``: how the run's processes are laid out on one DeviceMesh.

Dimensions, in the mesh's order (outermost first): ``dp_replicate`` (data parallel, weights
replicated), ``dp_shard`` (data parallel, weights sharded: FSDP2), ``cp`` (context parallel: each
rank holds a slice of every sequence), ``tp`` (tensor parallel: each rank holds a slice of each
weight). HSDP is dp_replicate x dp_shard. Ranks that differ only in ``tp``/``cp`` see the same batch.

This module builds the mesh and checks the sizes; the strategies lay the model out on it (their
``StrategyDescription.mesh_dims`` says which dimensions each one can).
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Mapping

from lowbit.kernel.errors import ConfigError, did_you_mean

# Canonical order of the mesh's dimensions (outermost first), as Accelerate and torchtitan lay them.
MESH_ORDER = ("dp_replicate", "dp_shard", "cp", "sp", "tp")
ENV_PREFIX = "PARALLELISM_CONFIG_"  # the variables Accelerate's launcher exports, read when a field is not given
CP_BACKENDS = ("torch",)
# sp_backend values (Accelerate's default names DeepSpeed's Ulysses); lowbit accepts the name and
# refuses sp_size > 1.
SEQUENCE_PARALLEL_BACKENDS = ("deepspeed",)


@dataclasses.dataclass
class TorchTensorParallelConfig:
    """Tensor-parallel settings. ``plan`` (lowbit's addition): the layout of each module, by module
    name (``*`` matches one name part, e.g. ``model.layers.*.mlp.up_proj``), as a transformers style
    name ("colwise", "rowwise", ...) or a torch ``ParallelStyle``; used instead of the model's own plan."""

    enable_async_tp: bool = False
    plan: Mapping[str, Any] | None = None

    def __post_init__(self) -> None:
        if self.enable_async_tp:
            raise ConfigError(
                "enable_async_tp=True is not offered by lowbit: its tensor parallelism runs the collectives "
                "synchronously. Remove it (Accelerate ignores it with a warning)."
            )


@dataclasses.dataclass
class TorchContextParallelConfig:
    """Context-parallel settings: how the ranks exchange keys and values ("allgather" or "alltoall")."""

    cp_comm_strategy: str | None = None

    def __post_init__(self) -> None:
        if self.cp_comm_strategy is None:
            self.cp_comm_strategy = os.environ.get(ENV_PREFIX + "CP_COMM_STRATEGY", "allgather")
        if self.cp_comm_strategy not in ("allgather", "alltoall"):
            raise ConfigError(
                f"Invalid cp_comm_strategy: {self.cp_comm_strategy} (the ranks exchange keys and values "
                "by allgather or alltoall)."
            )


@dataclasses.dataclass
class DeepSpeedSequenceParallelConfig:
    """DeepSpeed's sequence-parallel (Ulysses) settings, as Accelerate names them. lowbit checks them
    and refuses ``sp_size > 1`` at the Accelerator (no strategy of lowbit's lays out Ulysses yet)."""

    sp_seq_length: int | None = None
    sp_seq_length_is_variable: bool | None = None
    sp_attn_implementation: str | None = None

    # Attention kernels that can split heads across ranks (a hub kernel id naming flash-attn too).
    ATTENTION = ("flash_attention_2", "flash_attention_3", "sdpa")

    def __post_init__(self) -> None:
        if self.sp_seq_length_is_variable is None:
            self.sp_seq_length_is_variable = (
                os.environ.get(ENV_PREFIX + "SP_SEQ_LENGTH_IS_VARIABLE", "true").lower() == "true"
            )
        if not self.sp_seq_length_is_variable and self.sp_seq_length is None:
            length = os.environ.get(ENV_PREFIX + "SP_SEQ_LENGTH")
            if length is None:
                raise ConfigError(
                    "sp_seq_length_is_variable=False needs the fixed length: sp_seq_length=... or "
                    f"{ENV_PREFIX}SP_SEQ_LENGTH."
                )
            self.sp_seq_length = None if length == "None" else int(length)
        self.sp_attn_implementation = self.sp_attn_implementation or os.environ.get(
            ENV_PREFIX + "SP_ATTN_IMPLEMENTATION"
        )
        kernel = self.sp_attn_implementation
        if kernel is not None and kernel not in self.ATTENTION and not ("/" in kernel and "flash-attn" in kernel):
            raise ConfigError(
                f"Invalid sp_attn_implementation {kernel!r}: sequence parallelism needs one of "
                f"{', '.join(self.ATTENTION)}, or a hub flash-attention kernel such as "
                "'kernels-community/flash-attn2' (eager and flex attention cannot split heads)."
            )


@dataclasses.dataclass
class ParallelismConfig:
    """The sizes of each parallel dimension; their product is the number of processes. A size
    left as None comes from ``PARALLELISM_CONFIG_<NAME>``, else 1."""

    dp_replicate_size: int | None = None
    dp_shard_size: int | None = None
    tp_size: int | None = None
    cp_size: int | None = None
    cp_backend: str | None = None
    sp_size: int | None = None
    sp_backend: str | None = None
    tp_handler: TorchTensorParallelConfig | None = None
    cp_handler: TorchContextParallelConfig | None = None
    sp_handler: Any = None

    def __post_init__(self) -> None:
        for dim in MESH_ORDER:
            field = f"{dim}_size"
            value = getattr(self, field)
            if value is None:
                value = _env_size(ENV_PREFIX + field.upper())
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"ParallelismConfig {field} must be a whole number >= 1, got {value!r}.")
            setattr(self, field, value)
        self.cp_backend = self.cp_backend or os.environ.get(ENV_PREFIX + "CP_BACKEND", "torch")
        self.sp_backend = self.sp_backend or os.environ.get(ENV_PREFIX + "SP_BACKEND", SEQUENCE_PARALLEL_BACKENDS[0])
        if self.cp_backend not in CP_BACKENDS:
            raise ConfigError(
                f"ParallelismConfig cp_backend {self.cp_backend!r} is not one of {', '.join(CP_BACKENDS)}."
            )
        if self.sp_backend not in SEQUENCE_PARALLEL_BACKENDS:
            raise ConfigError(
                f"ParallelismConfig sp_backend {self.sp_backend!r} is not one of "
                f"{', '.join(SEQUENCE_PARALLEL_BACKENDS)}."
            )
        if self.tp_size > 1 and self.tp_handler is None:
            self.tp_handler = TorchTensorParallelConfig()
        if self.cp_size > 1 and self.cp_handler is None:
            self.cp_handler = TorchContextParallelConfig()
        if (self.tp_enabled or self.cp_enabled) and self.dp_replicate_enabled and not self.dp_shard_enabled:
            raise ConfigError(
                "ParallelismConfig: tensor/context parallelism with dp_replicate_size > 1 needs dp_shard_size > 1 too "
                "(replicas of a sharded model, not of whole ones). Use dp_shard_size for 2-D parallelism, "
                "or both for 3-D."
            )
        self.device_mesh = None

    # ------------------------------------------------------------------ which dimensions are on

    @property
    def dp_replicate_enabled(self) -> bool:
        return self.dp_replicate_size > 1

    @property
    def dp_shard_enabled(self) -> bool:
        return self.dp_shard_size > 1

    @property
    def tp_enabled(self) -> bool:
        return self.tp_size > 1

    @property
    def cp_enabled(self) -> bool:
        return self.cp_size > 1

    @property
    def sp_enabled(self) -> bool:
        return self.sp_size > 1

    def _enabled(self, dims: tuple[str, ...]) -> list[str]:
        return [dim for dim in dims if getattr(self, f"{dim}_size") > 1]

    @property
    def active_mesh_dims(self) -> list[str]:
        """The mesh's dimensions, outermost first: those with a size above 1."""
        return self._enabled(MESH_ORDER)

    @property
    def dp_dim_names(self) -> list[str]:
        """Dimensions whose ranks see different batches."""
        return self._enabled(("dp_replicate", "dp_shard"))

    @property
    def non_dp_dim_names(self) -> list[str]:
        """Dimensions whose ranks see the same batch."""
        return self._enabled(("tp", "cp", "sp"))

    @property
    def dp_shard_cp_dim_names(self) -> list[str]:
        """Dimensions FSDP2 shards the weights over (context-parallel ranks shard them too)."""
        return self._enabled(("dp_shard", "cp"))

    @property
    def dp_cp_dim_names(self) -> list[str]:
        """Dimensions a loss is averaged over."""
        return self._enabled(("dp_replicate", "dp_shard", "cp"))

    @property
    def fsdp_dim_names(self) -> list[str]:
        """FSDP2's mesh: (dp_replicate, dp_shard_cp) for HSDP, else (dp_shard_cp,)."""
        return (["dp_replicate"] if self.dp_replicate_enabled else []) + ["dp_shard_cp"]

    @property
    def total_size(self) -> int:
        return self.dp_replicate_size * self.dp_shard_size * self.tp_size * self.cp_size * self.sp_size

    @property
    def data_parallel_size(self) -> int:
        return self.dp_replicate_size * self.dp_shard_size

    @property
    def non_data_parallel_size(self) -> int:
        return self.tp_size * self.cp_size * self.sp_size

    # ------------------------------------------------------------------ the mesh

    def build_device_mesh(self, device_type: str):
        """One DeviceMesh over every process, with the flattened views ``dp``, ``dp_shard_cp`` and
        ``dp_cp`` where their dimensions are on; None when no dimension is (one process)."""
        names, shape = self._get_mesh()
        if not names:
            return None
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh(device_type, shape, mesh_dim_names=names)
        for name, parts in (
            ("dp", self.dp_dim_names),
            ("dp_shard_cp", self.dp_shard_cp_dim_names),
            ("dp_cp", self.dp_cp_dim_names),
        ):
            if parts:
                # torch's only way to name a joint dimension (torchtitan does it too); the list of
                # names, as Accelerate passes it
                mesh[parts]._flatten(name)
        return mesh

    def _get_mesh(self) -> tuple[tuple[str, ...], tuple[int, ...]]:
        """The mesh's dimension names and sizes, outermost first (Accelerate's name for it)."""
        dims = self.active_mesh_dims
        return tuple(dims), tuple(getattr(self, f"{d}_size") for d in dims)

    def get_device_mesh(self, device_type: str | None = None):
        if self.device_mesh is None:
            if device_type is None:
                raise ConfigError("The device mesh is not built yet: give the device type (e.g. 'cuda' or 'cpu').")
            self.device_mesh = self.build_device_mesh(device_type)
        elif device_type is not None and self.device_mesh.device_type != device_type:
            raise ConfigError(f"The device mesh was built for {self.device_mesh.device_type!r}, not {device_type!r}.")
        return self.device_mesh

    def fit_to(
        self, world_size: int, strategy: str, mesh_dims: tuple[str, ...], others: Mapping[str, tuple[str, ...]]
    ) -> None:
        """Check the layout against the job and the chosen strategy. An all-ones config on several
        processes spreads them over the strategy's data-parallel dimension (dp_shard for FSDP2,
        dp_replicate for DDP). ``others``: each installed strategy's dimensions, to name one that fits."""
        if self.total_size == 1 and world_size > 1:
            dim = next((d for d in ("dp_shard", "dp_replicate") if d in mesh_dims), None)
            if dim is not None:
                setattr(self, f"{dim}_size", world_size)
        if self.total_size != world_size:
            sizes = " x ".join(
                f"{d}_size={getattr(self, f'{d}_size')}" for d in MESH_ORDER if getattr(self, f"{d}_size") > 1
            )
            raise ConfigError(
                f"ParallelismConfig lays out {self.total_size} processes ({sizes or 'all sizes 1'}), but the job "
                f"has {world_size}. Make the product of the sizes {world_size}, or launch {self.total_size} processes."
            )
        missing = [d for d in self.active_mesh_dims if d not in mesh_dims]
        if missing:
            fits = [name for name, dims in others.items() if all(d in dims for d in self.active_mesh_dims)]
            hint = f" Use distributed_type {' or '.join(fits)} (e.g. `lowbit launch --use_fsdp`)." if fits else ""
            raise ConfigError(
                f"ParallelismConfig asks for {', '.join(f'{d}_size > 1' for d in missing)}, which the "
                f"{strategy!r} strategy does not lay out (it does: {', '.join(mesh_dims) or 'none'}).{hint}"
            )

    @classmethod
    def from_section(cls, section: Mapping[str, Any], where: str) -> "ParallelismConfig":
        """From a config file's ``parallelism_config`` section (Accelerate's ``parallelism_config_``
        prefix already dropped); its keys are this class's fields."""
        fields = [f.name for f in dataclasses.fields(cls) if not f.name.endswith("_handler")] + ["cp_comm_strategy"]
        for key in section:
            if key not in fields:
                raise ConfigError(
                    f"Unknown key {key!r} in parallelism_config (from {where}).{did_you_mean(key, fields)} "
                    f"Valid keys: {', '.join(fields)}."
                )
        values = dict(section)
        comm = values.pop("cp_comm_strategy", None)
        sizes = {k: _int(v, k, where) if k.endswith("_size") else v for k, v in values.items()}
        handler = TorchContextParallelConfig(cp_comm_strategy=comm) if comm is not None else None
        return cls(**sizes, cp_handler=handler)


def _int(value: Any, key: str, where: str) -> int:
    try:
        return int(str(value))
    except ValueError:
        raise ConfigError(f"parallelism_config.{key} in {where} must be a whole number, got {value!r}.") from None


def _env_size(name: str) -> int:
    value = os.environ.get(name, "")
    return _int(value, name, "the environment") if value != "" else 1


def settle_layout(
    given: ParallelismConfig | None,
    section: Mapping[str, Any],
    where: str,
    world_size: int,
    device_type: str,
    strategy: str,
    mesh_dims: tuple[str, ...],
    others: Mapping[str, tuple[str, ...]],
) -> ParallelismConfig | None:
    """The run's layout: the one given to the Accelerator, else the config's ``parallelism_config``
    section (file, ``lowbit launch --parallelism_config_*`` or Accelerate's launcher variables);
    checked against the job and the strategy, with its mesh built. None when none was asked for."""
    layout = given if given is not None else (ParallelismConfig.from_section(section, where) if section else None)
    if layout is None:
        return None
    if layout.sp_enabled:
        raise ConfigError(
            f"ParallelismConfig sp_size={layout.sp_size} asks for sequence parallelism (Ulysses), which "
            "lowbit does not offer. Use cp_size (context parallelism) instead."
        )
    if layout.cp_enabled and device_type != "cuda":
        # torch has no sharding rule for the CPU attention kernel (_scaled_dot_product_flash_attention_for_cpu).
        raise ConfigError(
            f"cp_size={layout.cp_size} asks for context parallelism, which torch runs on CUDA GPUs only "
            f"(this run is on {device_type}). Set cp_size=1 here."
        )
    layout.fit_to(world_size, strategy, mesh_dims, others)
    layout.get_device_mesh(device_type)
    return layout


def data_parallel_slot(layout: ParallelismConfig | None, world_size: int, rank: int) -> tuple[int, int]:
    """How many different batches the job sees at a time, and which one this process gets: ranks
    that differ only in tp/cp share one."""
    if layout is None or layout.device_mesh is None:
        return world_size, rank
    if not layout.dp_dim_names:
        return 1, 0
    dp = layout.device_mesh["dp"]
    return dp.size(), dp.get_local_rank()
