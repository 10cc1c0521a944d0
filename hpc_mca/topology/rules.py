"""check_layout: the rules every layout must satisfy, planned or forced by a user.

Each rule mirrors a check Megatron-Core makes at start-up (parallel_state.initialize_model_parallel,
TransformerConfig.__post_init__, the pipeline schedules), so a job that passes here does not die
minutes later on 1,024 GPUs. Problems are reported one line per offending field: the field, its
value, what it breaks, and the nearest values that would pass with everything else unchanged.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from .layout import FIELD_NAMES, Layout, balanced_pipeline_layout, divisors, nearest, world_violations
from .model import ModelShape


@dataclass(frozen=True)
class _Job:
    """Everything a rule may look at; optional facts are None when the caller did not give them."""

    layout: Layout
    world_size: int
    model: ModelShape | None
    gpus_per_node: int | None
    global_batch_size: int | None
    micro_batch_size: int
    seq_length: int | None
    sequence_packing: bool
    sequence_parallel_given: bool | None
    cp_comm_type: str | None = None
    mtp_num_layers: int = 0

    def sequence_parallel(self, tp: int) -> bool:
        """Sequence parallelism at TP size ``tp``: as given, else on whenever TP > 1."""
        return tp > 1 if self.sequence_parallel_given is None else self.sequence_parallel_given

    @property
    def dp(self) -> int | None:
        """Data-parallel size, or None while TP·PP·CP does not divide the world."""
        mp = self.layout.model_parallel_size
        return None if self.world_size % mp else self.world_size // mp


def check_layout(
    layout: Layout,
    world_size: int,
    model: ModelShape | None = None,
    *,
    gpus_per_node: int | None = None,
    global_batch_size: int | None = None,
    micro_batch_size: int | None = None,
    seq_length: int | None = None,
    sequence_packing: bool = False,
    sequence_parallel: bool | None = None,
    cp_comm_type: str | None = None,
    mtp_num_layers: int = 0,
) -> list[str]:
    """Return violations, one line each (empty list = valid).

    Each line names the field, the value, and the nearest valid choices, e.g.
    ``"tensor_parallel_size=3 does not divide num_attention_heads=32; valid: 1, 2, 4, 8"``.
    Rules that need a fact the caller left out (model, batch sizes, sequence length, node size)
    are skipped. ``sequence_parallel`` defaults to on whenever TP > 1, as in our recipes.
    ``cp_comm_type`` "a2a" (Ulysses) adds its head rule under CP; ``mtp_num_layers`` adds the
    rule that the last pipeline stage has room for the MTP layers.
    """
    bad_input = _input_violations(world_size, gpus_per_node, global_batch_size,
                                  micro_batch_size, seq_length)
    if bad_input:
        return bad_input
    job = _Job(layout, world_size, model, gpus_per_node, global_batch_size,
               micro_batch_size or 1, seq_length, sequence_packing, sequence_parallel,
               cp_comm_type, mtp_num_layers)
    tp_lines = _tp_lines(job)
    tp_pp_lines = tp_lines + _pp_lines(job)
    # A bad TP also breaks the sequence alignment it is part of; say so once, on the TP line.
    seq_lines = [] if tp_lines else _seq_lines(job)
    lines = tp_pp_lines + [line for rule in _OTHER_FIELD_RULES for line in rule(job)] + seq_lines
    # The TP and PP lines already suggest values that make TP·PP·CP divide the world, so the
    # product rule only gets its own line when neither of them fired.
    if job.dp is not None or not tp_pp_lines:
        lines += world_violations(layout, world_size)
    return lines + _batch_lines(job)


def _input_violations(world_size: int, gpus_per_node: int | None, global_batch_size: int | None,
                      micro_batch_size: int | None, seq_length: int | None) -> list[str]:
    values = {"world_size": world_size, "gpus_per_node": gpus_per_node,
              "global_batch_size": global_batch_size, "micro_batch_size": micro_batch_size,
              "seq_length": seq_length}
    return [
        f"{name}={value!r} must be a positive integer"
        for name, value in values.items()
        if (value is not None or name == "world_size")
        and (not isinstance(value, int) or isinstance(value, bool) or value < 1)
    ]


def _line(field: str, value: object, problems: list[str], valid: list[int] | str) -> list[str]:
    """One violation line, or nothing when there are no problems."""
    if not problems:
        return []
    shown = valid if isinstance(valid, str) else ", ".join(map(str, valid)) or "none"
    return [f"{field}={value} {_and(problems)}; valid: {shown}"]


def _and(parts: list[str]) -> str:
    return parts[0] if len(parts) == 1 else ", ".join(parts[:-1]) + " and " + parts[-1]


def _node_problem(size: int, gpus_per_node: int | None) -> list[str]:
    """TP-like groups are contiguous ranks, so they stay in a node only if they divide it."""
    if gpus_per_node is None or gpus_per_node % size == 0:
        return []
    if size > gpus_per_node:
        return [f"exceeds gpus_per_node={gpus_per_node} (its groups must stay inside a node)"]
    return [f"does not divide gpus_per_node={gpus_per_node} (its groups would straddle nodes)"]


# --- tensor parallel ------------------------------------------------------------------------

def _tp_problems(tp: int, job: _Job) -> list[str]:
    problems: list[str] = []
    model = job.model
    if model is None:
        return _node_problem(tp, job.gpus_per_node)
    # Only the first model constraint TP breaks is named: it is the root cause, and the valid
    # list already honours the rest.
    groups = model.num_query_groups
    if model.num_attention_heads % tp:
        problems.append(f"does not divide num_attention_heads={model.num_attention_heads}")
    elif groups % tp:
        # Megatron itself would accept a multiple of the KV-head count (it replicates each KV
        # head over TP ranks), but an HF checkpoint's K/V weights are imported by slicing whole
        # heads per TP rank: every rank must own at least one KV head of its own.
        problems.append(f"does not divide num_query_groups={groups} (the KV heads: each "
                        "TP rank holds whole ones)")
    elif model.ffn_hidden_size % tp:
        problems.append(f"does not divide ffn_hidden_size={model.ffn_hidden_size}")
    return problems + _node_problem(tp, job.gpus_per_node)


def _tp_lines(job: _Job) -> list[str]:
    lay = job.layout
    problems = _tp_problems(lay.tp, job)
    if not problems:
        return []
    rest = lay.pp * lay.cp
    valid = [t for t in divisors(job.world_size)
             if job.world_size % (t * rest) == 0 and not _tp_problems(t, job)
             and (job.seq_length is None or job.seq_length % seq_alignment(
                 lay.cp, t, job.sequence_parallel(t)) == 0)]
    return _line(FIELD_NAMES["tp"], lay.tp, problems, nearest(lay.tp, valid))


# --- pipeline and virtual pipeline ----------------------------------------------------------

def _pp_lines(job: _Job) -> list[str]:
    lay, model = job.layout, job.model
    if model is None or lay.pipeline_layout is not None or model.num_layers % lay.pp == 0:
        return []
    rest = lay.tp * lay.cp
    valid = ", ".join(map(str, nearest(lay.pp, [p for p in divisors(model.num_layers)
                                                 if job.world_size % (p * rest) == 0])))
    split = balanced_pipeline_layout(model.num_layers, lay.pp) if lay.vp is None else None
    if split is not None:
        valid += f", or this size with an uneven split: pipeline_layout={','.join(map(str, split))}"
    return _line(FIELD_NAMES["pp"], lay.pp,
                 [f"does not divide num_layers={model.num_layers}"], valid)


def _vp_lines(job: _Job) -> list[str]:
    lay, model = job.layout, job.model
    if lay.vp is None:
        return []
    if lay.pp == 1:
        return [f"{FIELD_NAMES['vp']}={lay.vp} needs {FIELD_NAMES['pp']} > 1 "
                "(interleaving splits each pipeline stage); valid: None"]
    if model is None or lay.pipeline_layout is not None or model.num_layers % lay.pp:
        return []
    per_stage = model.num_layers // lay.pp
    if per_stage % lay.vp == 0:
        return []
    return _line(FIELD_NAMES["vp"], lay.vp,
                 [f"does not divide the {per_stage} layers per pipeline stage "
                  f"(num_layers={model.num_layers} / {FIELD_NAMES['pp']}={lay.pp})"],
                 "None, " + ", ".join(map(str, nearest(lay.vp, divisors(per_stage)))))


def _pipeline_layout_lines(job: _Job) -> list[str]:
    """An explicit per-stage layer list replaces the even-split rule but must add up."""
    lay, model = job.layout, job.model
    stages = lay.pipeline_layout
    if stages is None:
        return []
    lines = []
    if len(stages) != lay.num_virtual_stages:
        lines.append(f"pipeline_layout has {len(stages)} stages but {FIELD_NAMES['pp']}×"
                     f"{FIELD_NAMES['vp']}={lay.pp}×{lay.vp or 1}={lay.num_virtual_stages}; "
                     f"valid: {lay.num_virtual_stages} stages")
    if model is not None and sum(stages) != model.num_layers:
        lines.append(f"pipeline_layout places {sum(stages)} layers but "
                     f"num_layers={model.num_layers}; valid: a sum of {model.num_layers}")
    return lines


def _mtp_lines(job: _Job) -> list[str]:
    """Every MTP layer runs on the last pipeline stage, after that stage's even share of the
    decoder layers (an even split moves no decoder layer away to make room). More MTP layers
    than that share would leave the last stage over twice as slow as every other stage."""
    lay, model, depths = job.layout, job.model, job.mtp_num_layers
    if depths and lay.pipeline_layout is not None:
        return [f"mtp_num_layers={depths} with pipeline_layout: MTP layers go on the last stage "
                "of an even split; valid: no pipeline_layout"]
    if not depths or lay.pp == 1 or model is None or model.num_layers % lay.pp:
        return []
    last = model.num_layers // lay.pp
    if depths <= last:
        return []
    rest = lay.tp * lay.cp
    valid = [p for p in divisors(model.num_layers)
             if (p == 1 or model.num_layers // p >= depths) and job.world_size % (p * rest) == 0]
    return _line(FIELD_NAMES["pp"], lay.pp,
                 [f"leaves {last} decoder layers on the last stage (num_layers="
                  f"{model.num_layers}), fewer than the mtp_num_layers={depths} MTP layers "
                  "that also run there"],
                 ", ".join(map(str, nearest(lay.pp, valid))) + f", or mtp_num_layers <= {last}")


# --- context parallel / sequence length ------------------------------------------------------

def seq_alignment(cp: int, tp: int, sequence_parallel: bool) -> int:
    """Multiple every sequence length must be: CP cuts each sequence into 2·CP chunks (two per
    rank, for causal load balance) and sequence parallelism cuts each rank's share across TP."""
    return (2 * cp if cp > 1 else 1) * (tp if sequence_parallel else 1)


def _seq_lines(job: _Job) -> list[str]:
    lay, seq = job.layout, job.seq_length
    sp = job.sequence_parallel(lay.tp)
    align = seq_alignment(lay.cp, lay.tp, sp)
    if seq is None or seq % align == 0:
        return []
    factors = (["2·CP"] if lay.cp > 1 else []) + (["TP"] if sp else [])
    sizes = ([f"{FIELD_NAMES['cp']}={lay.cp}"] if lay.cp > 1 else []) + (
        [f"{FIELD_NAMES['tp']}={lay.tp} with sequence parallelism"]
        if sp else [])
    why = f"a multiple of {'·'.join(factors)}={align} ({', '.join(sizes)})"
    if job.sequence_packing and lay.cp > 1:
        why += "; with sequence packing every packed sequence must be padded to it"
    valid = [m for m in (seq // align * align, (seq // align + 1) * align) if m > 0]
    return _line("seq_length", seq, [f"is not {why}"], valid)


def _cp_comm_lines(job: _Job) -> list[str]:
    """Ulysses (a2a) splits each TP rank's key/value heads over the CP ranks."""
    lay, model = job.layout, job.model
    if job.cp_comm_type != "a2a" or lay.cp == 1 or model is None:
        return []
    if model.num_query_groups % lay.tp:
        return []  # the TP rule reports it
    local = model.num_query_groups // lay.tp
    if local % lay.cp == 0:
        return []
    return _line(FIELD_NAMES["cp"], lay.cp,
                 [f"does not divide the {local} key/value heads per tensor-parallel rank that "
                  "cp_comm_type='a2a' splits"],
                 ", ".join(map(str, divisors(local))) + ", or cp_comm_type='all_gather'")


# --- experts ---------------------------------------------------------------------------------

def _stage_ranks(job: _Job) -> int | None:
    """Ranks of one pipeline stage (TP·CP·DP): the pool the expert grid ETP·EP·EDP re-slices."""
    dp = job.dp
    return None if dp is None else job.layout.tp * job.layout.cp * dp


def _ep_problems(ep: int, job: _Job, etp: int, blame_product: bool) -> list[str]:
    model, ranks = job.model, _stage_ranks(job)
    problems = []
    if model is not None and model.num_experts % ep:
        problems.append(f"does not divide num_experts={model.num_experts}")
    if blame_product and ranks is not None and ranks % (ep * etp):
        problems.append(f"× {FIELD_NAMES['etp']}={etp} does not divide the {ranks} ranks "
                        "of a pipeline stage (TP·CP·DP)")
    return problems


def _ep_lines(job: _Job) -> list[str]:
    lay, model = job.layout, job.model
    if model is not None and not model.is_moe:
        if lay.ep == 1:
            return []
        return [f"{FIELD_NAMES['ep']}={lay.ep} needs an MoE model (num_experts=0); valid: 1"]
    problems = _ep_problems(lay.ep, job, lay.etp, blame_product=lay.ep > 1)
    if not problems:
        return []
    pool = model.num_experts if model is not None else (_stage_ranks(job) or job.world_size)
    valid = [e for e in divisors(pool) if not _ep_problems(e, job, lay.etp, blame_product=True)]
    return _line(FIELD_NAMES["ep"], lay.ep, problems, nearest(lay.ep, valid))


def _etp_problems(etp: int, job: _Job, blame_product: bool) -> list[str]:
    problems = _node_problem(etp, job.gpus_per_node)
    model, ranks = job.model, _stage_ranks(job)
    if model is not None and model.expert_ffn_hidden_size % etp:
        problems.append(f"does not divide moe_ffn_hidden_size={model.expert_ffn_hidden_size}")
    if blame_product and ranks is not None and ranks % (etp * job.layout.ep):
        problems.append(f"× {FIELD_NAMES['ep']}={job.layout.ep} does not divide the {ranks} "
                        "ranks of a pipeline stage (TP·CP·DP)")
    return problems


def _etp_lines(job: _Job) -> list[str]:
    lay, model = job.layout, job.model
    if model is not None and not model.is_moe:
        return []  # Megatron ignores ETP without experts
    problems = _etp_problems(lay.etp, job, blame_product=lay.ep == 1)
    if not problems:
        return []
    valid = [t for t in divisors(job.gpus_per_node or job.world_size)
             if not _etp_problems(t, job, blame_product=True)]
    return _line(FIELD_NAMES["etp"], lay.etp, problems, nearest(lay.etp, valid))


# --- batch -----------------------------------------------------------------------------------

def _multiples_near(value: int, step: int) -> list[int]:
    below = value // step * step
    return [m for m in (below, below + step) if m > 0]


def _batch_lines(job: _Job) -> list[str]:
    """global = micro × DP × micro-batches; interleaving also wants micro-batches in PP groups."""
    gbs, mbs, dp, lay = job.global_batch_size, job.micro_batch_size, job.dp, job.layout
    if gbs is None or dp is None:
        return []
    if gbs % dp:
        return _line("global_batch_size", gbs,
                     [f"is not divisible by micro_batch_size×data_parallel_size={mbs}×{dp}"],
                     _multiples_near(gbs, mbs * dp))
    if gbs % (mbs * dp):
        return _line("micro_batch_size", mbs,
                     [f"does not divide global_batch_size/data_parallel_size={gbs}/{dp}="
                      f"{gbs // dp}"], nearest(mbs, divisors(gbs // dp)))
    microbatches = gbs // (mbs * dp)
    if lay.vp is None or lay.pp == 1 or microbatches % lay.pp == 0:
        return []
    # Megatron's interleaved schedule runs micro-batches in groups of PP; a ragged last group
    # is rejected at start-up ("dependency bubbles").
    return _line("global_batch_size", gbs,
                 [f"gives {microbatches} micro-batches (÷ micro_batch_size×data_parallel_size="
                  f"{mbs}×{dp}), not a multiple of {FIELD_NAMES['pp']}={lay.pp} as the "
                  f"interleaved schedule ({FIELD_NAMES['vp']}={lay.vp}) needs"],
                 _multiples_near(gbs, mbs * dp * lay.pp))


_OTHER_FIELD_RULES: tuple[Callable[[_Job], list[str]], ...] = (
    _vp_lines, _pipeline_layout_lines, _mtp_lines, _cp_comm_lines, _ep_lines, _etp_lines,
)
