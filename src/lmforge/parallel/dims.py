"""Parallel degrees of a run (``parallelism`` section + world size) and the device mesh they define.

The world is split as ``pp × dp_replicate × dp_shard × cp × tp`` (outermost first, so tensor-parallel
peers are neighbouring ranks, as on a real node). Expert parallel does not add a dimension: the expert
layers re-split the ``dp_shard × cp`` ranks into ``(dp_shard × cp / ep) × ep`` (experts are sharded
over ``ep``, their parameters FSDP-sharded over the rest), so every degree except ``ep`` multiplies to
the world size.

The original (mindformers.md §4.1) computes ``dp = world // (tp·pp·cp)`` with a floor division and no
divisibility check, and ``replicate = max(dp // shard, 1)``; a world that does not divide silently
leaves ranks out of the mesh. Here every degree must divide exactly, and the error names the key.
"""

from __future__ import annotations

import logging
import warnings
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from lmforge.config.sections_parallel import ParallelismConfig
from lmforge.errors import ConfigError

if TYPE_CHECKING:
    from lmforge.models.common.transformer_config import TransformerConfig

logger = logging.getLogger(__name__)

# Outermost to innermost; TP innermost keeps its (most frequent) collectives between neighbours.
MESH_DIM_NAMES = ("pp", "dp_replicate", "dp_shard", "cp", "tp")


def refuse_unimplemented(section: ParallelismConfig) -> None:
    """Values the spec allows that lmforge does not implement: refused, never ignored.

    A file that sets them is valid (it loads, as the original's does); it cannot run here, so the
    run plan refuses it before anything is built. ``from_section`` calls this, so every path from the
    section to the degrees (train, check, tools) refuses them once.
    """
    p = "parallelism"
    if section.context_parallel_mask_type != "causal":
        raise ConfigError(
            f"{p}.context_parallel_mask_type supports only 'causal' (document boundaries come from the "
            "data's attention_mask / actual_seq_len columns, which context parallel honours), got "
            f"{section.context_parallel_mask_type!r}."
        )
    if section.context_parallel > 1 and section.context_parallel_async:
        raise ConfigError(
            f"{p}.context_parallel_async: true (the original's Hyper-Parallel asynchronous CP hook on "
            "Ascend) is not supported; set it to false."
        )
    interleave, schedule = section.pipeline_parallel_interleave_num, section.pipeline_parallel_schedule
    if section.pipeline_parallel > 1 and interleave > 1 and schedule != "interleaved_1f1b":
        raise ConfigError(
            f"{p}.pipeline_parallel_interleave_num={interleave} needs "
            f"{p}.pipeline_parallel_schedule: interleaved_1f1b (got {schedule!r})."
        )
    if section.dense_fsdp_shard_size is not None:
        raise ConfigError(
            f"{p}.dense_fsdp_shard_size is not supported: the original declares it without documenting "
            f"it; use {p}.data_parallel_shard (HSDP) and {p}.expert_parallel, and leave it unset."
        )


@dataclass(frozen=True)
class ParallelDims:
    """The degree of every parallel dimension; their product (without ``ep``) is the world size."""

    world_size: int
    dp_replicate: int = 1
    dp_shard: int = 1
    cp: int = 1
    tp: int = 1
    pp: int = 1
    ep: int = 1
    ulysses: int = 1  # the Ulysses (all-to-all over heads) part of cp; cp // ulysses is the KV-gather part

    def __post_init__(self) -> None:
        product = self.pp * self.dp_replicate * self.dp_shard * self.cp * self.tp
        if product != self.world_size:
            raise ConfigError(
                f"parallel degrees pp={self.pp} × dp_replicate={self.dp_replicate} × dp_shard={self.dp_shard} × "
                f"cp={self.cp} × tp={self.tp} = {product} do not equal the world size {self.world_size}."
            )

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_section(cls, section: ParallelismConfig, world_size: int) -> ParallelDims:
        """Derive the degrees from the typed ``parallelism`` section for ``world_size`` processes.

        The section's own values (positive degrees, known names) were checked when it was typed; what
        is checked here needs the world size, or is valid but not implemented (:func:`refuse_unimplemented`). ``data_parallel_shard: -1`` gives every remaining rank
        to FSDP (pure FSDP); a smaller value gives HSDP with ``dp_replicate = dp / data_parallel_shard``
        replicas of the sharded group.
        """
        if not isinstance(section, ParallelismConfig):
            raise TypeError(
                "ParallelDims.from_section takes the typed parallelism section (load_config's "
                f"cfg.parallelism, or lmforge.config.validate_section('parallelism', mapping)), got "
                f"{type(section).__name__}"
            )
        if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
            raise ConfigError(f"the world size must be a positive integer, got {world_size!r}.")
        refuse_unimplemented(section)
        tp, pp = section.tensor_parallel, section.pipeline_parallel
        cp, ep = section.context_parallel, section.expert_parallel
        non_dp = tp * pp * cp
        if non_dp > world_size:
            # The original's message (mindformers.md §4.1), kept verbatim.
            raise ConfigError(
                f"tensor_parallel({tp}) * pipeline_parallel({pp}) * context_parallel({cp}) must be less than "
                f"or equal to world_size({world_size}). Lower parallelism.tensor_parallel, "
                "parallelism.pipeline_parallel or parallelism.context_parallel, or start more processes."
            )
        if world_size % non_dp:
            raise ConfigError(
                f"world size {world_size} is not divisible by parallelism.tensor_parallel({tp}) × "
                f"parallelism.pipeline_parallel({pp}) × parallelism.context_parallel({cp}) = {non_dp}; the "
                f"data-parallel degree would not be whole. Use a world size that is a multiple of {non_dp}."
            )
        dp = world_size // non_dp
        shard = section.data_parallel_shard
        if shard == -1:
            dp_shard, dp_replicate = dp, 1
        else:
            if shard > dp or dp % shard:
                raise ConfigError(
                    f"parallelism.data_parallel_shard={shard} must divide the data-parallel degree {dp} "
                    f"(world size {world_size} / (tensor × pipeline × context parallel = {non_dp})); valid "
                    f"values: -1 or one of {[d for d in range(1, dp + 1) if dp % d == 0]}."
                )
            dp_shard, dp_replicate = shard, dp // shard
        if (dp_shard * cp) % ep:
            raise ConfigError(
                f"parallelism.expert_parallel={ep} must divide data_parallel_shard × context_parallel = "
                f"{dp_shard} × {cp} = {dp_shard * cp}: expert parallelism borrows those ranks for the expert "
                f"layers. Valid values: {[d for d in range(1, dp_shard * cp + 1) if (dp_shard * cp) % d == 0]}."
            )
        ulysses = section.ulysses_degree_in_cp
        if ulysses is None:
            ulysses = cp if section.context_parallel_method == "ulysses" else 1
        if cp % ulysses:
            raise ConfigError(
                f"parallelism.ulysses_degree_in_cp must be a positive divisor of parallelism.context_parallel "
                f"({cp}), got {section.ulysses_degree_in_cp!r}."
            )
        return cls(
            world_size=world_size,
            dp_replicate=dp_replicate,
            dp_shard=dp_shard,
            cp=cp,
            tp=tp,
            pp=pp,
            ep=ep,
            ulysses=ulysses,
        )

    # ------------------------------------------------------------------ derived degrees
    @property
    def dp(self) -> int:
        """Data-parallel degree: the number of distinct batches per step."""
        return self.dp_replicate * self.dp_shard

    @property
    def fsdp_size(self) -> int:
        """Ranks that shard one parameter (FSDP shards over dp_shard × cp: cp ranks hold the same weights)."""
        return self.dp_shard * self.cp

    @property
    def expert_fsdp_size(self) -> int:
        return self.fsdp_size // self.ep

    @property
    def is_parallel(self) -> bool:
        return self.world_size > 1

    @property
    def cp_method(self) -> str:
        """How attention is split over the cp ranks: ``"hybrid"`` (Ulysses groups of ``ulysses`` ranks,
        K/V gathered across them), ``"ulysses"`` (all-to-all over heads) or ``"colossal"`` (load-balanced
        all-gather of K/V). ``from_section`` folded ``context_parallel_method`` into ``ulysses``."""
        if 1 < self.ulysses < self.cp:
            return "hybrid"
        if self.cp > 1 and self.ulysses == self.cp:
            return "ulysses"
        return "colossal"

    def describe(self) -> str:
        parts = [f"world={self.world_size}"]
        for name in ("pp", "dp_replicate", "dp_shard", "cp", "tp", "ep"):
            parts.append(f"{name}={getattr(self, name)}")
        if self.cp > 1:
            parts.append(f"ulysses={self.ulysses}")
        return " ".join(parts)

    # ------------------------------------------------------------------ model checks
    def check_transformer(
        self, cfg: TransformerConfig, section: ParallelismConfig, *, seq_length: int | None = None
    ) -> None:
        """:meth:`check_model` with the facts of a ``TransformerConfig`` (train, check and plan read them here).

        Multi-latent attention has no key/value heads to split (its latent K/V are replicated over tp).
        """
        self.check_model(
            num_layers=cfg.num_layers,
            num_heads=cfg.num_attention_heads,
            num_kv_heads=None if cfg.multi_latent_attention else cfg.num_key_value_heads,
            num_experts=cfg.num_experts or None,
            seq_length=seq_length,
            interleave=section.pipeline_parallel_interleave_num,
            layers_per_stage=section.pipeline_parallel_layers_per_stage,
            vocab_size=cfg.vocab_size,
        )

    def check_model(
        self,
        *,
        num_layers: int,
        num_heads: int | None = None,
        num_kv_heads: int | None = None,
        num_experts: int | None = None,
        seq_length: int | None = None,
        interleave: int = 1,
        layers_per_stage: Any = "auto",
        ffn_hidden_size: int | None = None,
        moe_ffn_hidden_size: int | None = None,
        vocab_size: int | None = None,
    ) -> None:
        """Raise a ConfigError when a degree does not divide the model it has to split."""
        tp, cp = self.tp, self.cp
        if tp > 1:
            if num_heads is not None and num_heads % tp:
                raise ConfigError(
                    f"parallelism.tensor_parallel={tp} must divide the number of attention heads "
                    f"(model num_attention_heads={num_heads})."
                )
            if num_kv_heads is not None and num_kv_heads % tp:
                raise ConfigError(
                    f"parallelism.tensor_parallel={tp} must divide the number of key/value heads "
                    f"(model num_query_groups / num_key_value_heads={num_kv_heads}); each TP rank holds whole "
                    f"KV groups."
                )
            for label, size in (
                ("ffn_hidden_size", ffn_hidden_size),
                ("moe_ffn_hidden_size", moe_ffn_hidden_size),
            ):
                if size is not None and size % tp:
                    raise ConfigError(
                        f"parallelism.tensor_parallel={tp} must divide the model's {label} ({size})."
                    )
            if vocab_size is not None and vocab_size % tp:
                raise ConfigError(
                    f"parallelism.tensor_parallel={tp} must divide the model's vocab_size ({vocab_size}) "
                    f"(the embedding and output layer are split by vocabulary rows)."
                )
        if self.ulysses > 1 and num_heads is not None:
            heads_per_tp = num_heads // tp
            if heads_per_tp % self.ulysses:
                raise ConfigError(
                    f"parallelism.ulysses_degree_in_cp={self.ulysses} must divide the attention heads per "
                    f"tensor-parallel rank ({num_heads} / {tp} = {heads_per_tp})."
                )
        if seq_length is not None:
            # Load-balanced causal sharding cuts the sequence into 2·cp chunks; SP splits it over tp.
            chunks = 2 * cp if cp > 1 else 1
            if seq_length % (chunks * tp):
                raise ConfigError(
                    f"the sequence length {seq_length} must be divisible by "
                    f"{'2 × parallelism.context_parallel × ' if cp > 1 else ''}parallelism.tensor_parallel "
                    f"= {chunks * tp} (context parallel splits it into {chunks} chunks, sequence parallel "
                    f"over {tp} ranks)."
                )
        if num_experts is not None and num_experts > 0 and num_experts % self.ep:
            raise ConfigError(
                f"parallelism.expert_parallel={self.ep} must divide the number of routed experts "
                f"(model num_experts / n_routed_experts={num_experts})."
            )
        if (num_experts is None or num_experts == 0) and self.ep > 1:
            raise ConfigError(
                f"parallelism.expert_parallel={self.ep} needs a mixture-of-experts model, but the model has "
                "no routed experts; set parallelism.expert_parallel: 1."
            )
        if self.pp > 1:
            from lmforge.parallel.pp_layout import stage_layers  # validates and raises ConfigError

            stage_layers(layers_per_stage, num_layers=num_layers, pp=self.pp, interleave=interleave)

    # ------------------------------------------------------------------ mesh
    def build_mesh(self, device_type: str = "cpu") -> ParallelMesh:
        """Create the device mesh (needs an initialised process group of ``world_size`` ranks)."""
        from torch.distributed.device_mesh import init_device_mesh

        shape = (self.pp, self.dp_replicate, self.dp_shard, self.cp, self.tp)
        world = init_device_mesh(device_type, shape, mesh_dim_names=MESH_DIM_NAMES)
        # The flattened meshes are kept as _flatten returns them: slicing them from the root mesh later
        # is deprecated in torch (a UserWarning on every run).
        flattened = {
            "dp": world["dp_replicate", "dp_shard"]._flatten("dp"),
            "dp_shard_cp": world["dp_shard", "cp"]._flatten("dp_shard_cp"),
            "dp_cp": world["dp_replicate", "dp_shard", "cp"]._flatten("dp_cp"),
            "dp_cp_tp": world["dp_replicate", "dp_shard", "cp", "tp"]._flatten("dp_cp_tp"),  # distinct tokens
        }
        expert = None
        if self.ep > 1:
            # Expert layers re-split the same ranks: (pp, dp_replicate, dp_shard·cp/ep, ep, tp).
            expert = init_device_mesh(
                device_type,
                (self.pp, self.dp_replicate, self.expert_fsdp_size, self.ep, self.tp),
                mesh_dim_names=("pp", "dp_replicate", "edp_shard", "ep", "tp"),
            )
        cp_split = None
        if 1 < self.ulysses < self.cp:
            # Hybrid context parallel: the cp ranks as (cp_ring, cp_uly), same rank order as "cp".
            cp_split = init_device_mesh(
                device_type,
                (self.pp, self.dp_replicate, self.dp_shard, self.cp // self.ulysses, self.ulysses, self.tp),
                mesh_dim_names=("pp", "dp_replicate", "dp_shard", "cp_ring", "cp_uly", "tp"),
            )
        return ParallelMesh(dims=self, world=world, expert=expert, cp_split=cp_split, flattened=flattened)


@dataclass
class ParallelMesh:
    """The device meshes of a run, with the sub-meshes the other pieces ask for by name."""

    dims: ParallelDims
    world: Any  # DeviceMesh ("pp", "dp_replicate", "dp_shard", "cp", "tp") + flattened "dp", "dp_shard_cp",
    # "dp_cp" and "dp_cp_tp"
    expert: Any = None  # DeviceMesh ("pp", "dp_replicate", "edp_shard", "ep", "tp"), only when ep > 1
    cp_split: Any = None  # DeviceMesh with cp as ("cp_ring", "cp_uly"), only for hybrid Ulysses
    flattened: dict[str, Any] = field(default_factory=dict)  # "dp", "dp_shard_cp", ... as _flatten made them

    def __getitem__(self, name: str) -> Any:
        return self.flattened[name] if name in self.flattened else self.world[name]

    @property
    def dp_rank(self) -> int:
        """Which data shard this rank reads (tp, cp and pp peers read the same one)."""
        return self["dp"].get_local_rank()

    @property
    def dp_size(self) -> int:
        return self.dims.dp

    def fsdp_mesh(self) -> Any:
        """1-D (pure FSDP) or 2-D (HSDP: replicate × shard) mesh for non-expert parameters."""
        if self.dims.dp_replicate > 1:
            # A real and a flattened dimension together: torch has no other way to this 2-D mesh than
            # slicing the root (deprecated, with a warning that would repeat on every HSDP run).
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message="Slicing a flattened dim from root mesh")
                return self.world["dp_replicate", "dp_shard_cp"]
        return self["dp_shard_cp"]

    def expert_fsdp_mesh(self) -> Any:
        if self.expert is None:
            return self.fsdp_mesh()
        if self.dims.dp_replicate > 1:
            return self.expert["dp_replicate", "edp_shard"]
        return self.expert["edp_shard"]
