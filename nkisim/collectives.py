"""nki.collectives (SDK-CC). Phase 1: only the types exist; multi-rank execution is not implemented."""
from dataclasses import dataclass, field


@dataclass
class ReplicaGroup:
    groups: list = field(default_factory=list)


def _missing(name):
    def f(*args, **kwargs):
        raise NotImplementedError(f"ncc.{name}: collectives across ranks are not implemented by nkisim yet")
    f.__name__ = name
    return f


for _n in ("all_reduce", "all_gather", "all_gather_v", "reduce_scatter", "all_to_all", "all_to_all_v",
           "collective_permute", "collective_permute_implicit", "collective_permute_implicit_reduce",
           "collective_permute_implicit_current_processing_rank_id", "rank_id"):
    globals()[_n] = _missing(_n)
del _n
