"""What a plan says: its memory terms, the verdict against the memory there is, the suggested changes and,
with several processes, each strategy's peak; and the plan as JSON."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Term:
    key: str
    bytes: int
    detail: str


@dataclass
class Suggestion:
    changes: dict  # dotted recipe key -> new value
    saving: int  # bytes
    cost: str
    peak: int


@dataclass
class StrategyFit:
    """One strategy's per-process peak, for the comparison a plan of several processes prints."""

    peak: int
    fits: bool | None
    changes: dict  # the recipe changes that select it ({} for the recipe's own)


@dataclass
class Plan:
    device: str
    precision: str
    terms: list[Term]
    memory: int | None  # bytes available, None when unknown
    memory_source: str
    assumptions: list[str] = field(default_factory=list)
    suggestions: list[Suggestion] = field(default_factory=list)
    fit_changes: dict | None = None  # the combination `--fit` writes
    fit_peak: int | None = None  # the peak predicted with fit_changes applied
    method: str = "lora"  # peft.method
    trainable_params: int | None = None
    method_detail: str = ""  # "method full: 494,032,768 trainable parameters (all)"
    processes: int = 1  # the plan describes one of them
    nodes: int = 1
    strategy: str = "single"  # single | ddp | fsdp
    share: int = 1  # processes whose peaks the memory must hold together: a CPU node's processes share its RAM
    strategies: dict[str, StrategyFit] | None = None  # several processes: the peak under each strategy
    offloaded: list[Term] = field(default_factory=list)  # fsdp's cpu_offload: in CPU memory, not in the peak
    time: object | None = None  # gpupoor.plan.time.estimate.TimePlan, when asked for (plan does; validate never)
    time_error: str | None = None  # why there is no time plan, when one was asked for
    time_keys: tuple[str, str] | None = None  # (machine, step key) in the time facts cache (gpupoor.plan.time.facts)

    @property
    def peak(self) -> int:
        return sum(term.bytes for term in self.terms)

    @property
    def comparable_peak(self) -> int:
        """The peak as gpupoor measures it (metrics' peak_mem_mb): on the CPU the process's RSS, on CUDA the
        tensors torch allocated -- without the context and the allocator's slack."""
        if self.device == "cpu":
            return self.peak
        return sum(t.bytes for t in self.terms if t.key != "overhead")

    @property
    def fits(self) -> bool | None:
        return None if self.memory is None else self.peak * self.share <= self.memory

    def to_json(self) -> dict:
        return {"device": self.device, "precision": self.precision, "peak_bytes": self.peak,
                "memory_bytes": self.memory, "memory_source": self.memory_source, "fits": self.fits,
                "terms": {t.key: {"bytes": t.bytes, "detail": t.detail} for t in self.terms},
                "assumptions": self.assumptions,
                "suggestions": [{"changes": s.changes, "saving_bytes": s.saving, "peak_bytes": s.peak,
                                 "cost": s.cost} for s in self.suggestions],
                "fit_changes": self.fit_changes, "method": self.method, "trainable_params": self.trainable_params,
                "method_detail": self.method_detail, **self._distributed_json(),
                **({"time": self.time.to_json()} if self.time is not None else {}),
                **({"time_error": self.time_error} if self.time_error else {})}

    def _distributed_json(self) -> dict:
        if self.processes == 1:
            return {}  # the single-process plan stays as it was
        fits = {name: {"peak_bytes": f.peak, "fits": f.fits, "changes": f.changes}
                for name, f in (self.strategies or {}).items()}
        return {"processes": self.processes, "nodes": self.nodes, "strategy": self.strategy,
                "processes_sharing_memory": self.share, "strategies": fits,
                "offloaded": {t.key: {"bytes": t.bytes, "detail": t.detail} for t in self.offloaded},
                "offloaded_bytes": sum(t.bytes for t in self.offloaded)}
