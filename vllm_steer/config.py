"""The server's steer configuration (``--steer`` and its sibling flags), carried to every
process in ``additional_config["vllm_steer"]``. Light: no torch import (the frontend uses it).
A request's steers are :mod:`vllm_steer.request`."""

from __future__ import annotations

import os
import sys
from dataclasses import asdict, dataclass, field
from typing import Any, Literal, Mapping

from vllm_steer import ADDITIONAL_CONFIG_KEY
from vllm_steer.names import echo, steer_name_problem
from vllm_steer.policy import parse_mix, strength_value

DEFAULT_MAX_STRENGTH = 50.0
#: The rank per steer the steer bank reserves without ``--max-steer-rank`` (or the largest
#: ``--steer`` file's rank, if larger): a run-time load of a larger rank is refused, so the bank
#: never allocates device memory outside what vLLM measured at start-up.
DEFAULT_RESERVED_RANK = 64
#: ``--max-steers-per-request`` unless given: the most steers one request may be served with
#: (presets, defaults and floors counted); the bank's capacity (``--max-steers``) bounds it too.
DEFAULT_MAX_STEERS_PER_REQUEST = 8
#: The largest ``--max-steers``, ``--max-steers-per-request`` and ``--max-steer-rank``: far
#: beyond any device (65,536 steers of rank 64 at hidden size 4096 in bf16 reserve 128 GiB),
#: so that a typo is refused by name before anything is built for it.
MAX_COUNT_FLAG = 65536


@dataclass
class SteerServerConfig:
    """What the server loads and allows; carried to workers in ``additional_config``."""

    steers: dict[str, str] = field(default_factory=dict)
    """Steer name -> path of its ``.safetensors`` file, as given by ``--steer NAME=PATH``."""
    max_strength: float = DEFAULT_MAX_STRENGTH
    """Largest ``|strength|`` a request may ask for (units of the steer's epsilon)."""
    backend: Literal["auto", "reference", "torch", "triton"] = "auto"
    """Implementation of the batched steer operation (see ``vllm_steer.ops``)."""
    max_steers: int | None = None
    """Steer slots (``--max-steers``): how many steers may be loaded at once; the per-request
    coefficient table and the bank are sized for it up front. Default: the number of
    ``--steer`` options, at least 8."""
    max_steers_per_request: int | None = None
    """``--max-steers-per-request``: the most steers one request may be served with, presets,
    ``--steer-default`` and ``--steer-floor`` counted (None:
    :data:`DEFAULT_MAX_STEERS_PER_REQUEST`).
    A request over it, or over what the bank holds at once (``--max-steers``), is an HTTP 400
    naming the count, the limit and the fix."""
    max_steer_rank: int | None = None
    """Largest rank a loaded steer may have (``--max-steer-rank``); None: any."""
    steer_dir: str | None = None
    """``--steer-dir``: a request naming a steer that is not loaded loads
    ``DIR/NAME.safetensors`` on first use."""
    enable_updates: bool = False
    """``--enable-steer-updates``: allow ``POST /v1/steers`` and ``DELETE /v1/steers/NAME``
    (load and unload steers), and ``POST /v1/steer-presets``, ``PUT`` and ``DELETE
    /v1/steer-presets/NAME`` (add, replace and delete presets)."""
    updates_any_path: bool = False
    """``--steer-updates-any-path``: ``POST /v1/steers`` may name a file outside
    ``--steer-dir`` (default: only files inside it)."""
    steer_drafter: bool = True
    """Speculative decoding: steer the drafter's rows too (a draft model, EAGLE, EAGLE-3 or MTP
    head of the steers' hidden size; under Model Runner V2, EAGLE-style drafters inside CUDA
    graphs reading the bank in place) to keep the acceptance rate up;
    ``--no-steer-drafter``: propose unsteered. Either way the output follows the steered
    target (rejection sampling)."""
    presets: dict[str, dict[str, float]] = field(default_factory=dict)
    """``--steer-preset NAME=detox:4,sentiment:2``: preset name -> steer mix. Each preset is
    served as a model name (listed in ``/v1/models``); a request with ``"model": NAME`` gets
    the mix (precedence: :mod:`vllm_steer.policy`)."""
    defaults: dict[str, float] = field(default_factory=dict)
    """``--steer-default detox=2``: steer -> strength applied to every request that names
    neither the steer nor a preset naming it (a request may override it, also with 0)."""
    floors: dict[str, float] = field(default_factory=dict)
    """``--steer-floor detox=2``: steer -> the least signed strength a request is served with;
    a request asking for less is raised to it (the response says so in
    ``x-vllm-steer-floored``)."""
    steer_vectors: bool = False
    """``--steer-vectors``: put the vector steers' op into the model's decoder layers even when
    no ``--steer`` file is a vector steer, so that vector steers can be loaded at run time
    (``--steer-dir``, ``POST /v1/steers``). A ``--steer`` vector file turns it on by itself;
    without either, the model is compiled exactly as vLLM builds it."""
    presets_file: str | None = None
    """``--steer-presets-file PATH``: a JSON or YAML file of presets (``{"presets": {"polite":
    {"detox": 4}}}``), served like ``--steer-preset`` ones and re-read by every API server when
    it changes (:mod:`vllm_steer.server.presets_file`). None: no file."""

    def __post_init__(self):
        if not (isinstance(self.max_strength, (int, float))
                and not isinstance(self.max_strength, bool)
                and 0 < self.max_strength <= sys.float_info.max):  # finite as a float too
            raise ValueError(f"--steer-max-strength={echo(self.max_strength, 40)}: must be a "
                             "positive "
                             f"finite number (default {DEFAULT_MAX_STRENGTH})")
        self.max_strength = float(self.max_strength)
        if not isinstance(self.steers, dict):
            raise ValueError(f"steers must map steer names to file paths, got "
                             f"{type(self.steers).__name__}")
        for name, path in self.steers.items():
            problem = steer_name_problem(name)
            if problem:
                raise ValueError(f"steers: {problem}")
            if not isinstance(path, (str, os.PathLike)):
                raise ValueError(f"steers[{name!r}]: expected a file path, got "
                                 f"{type(path).__name__}")
        for flag, v in (("--max-steers", self.max_steers),
                        ("--max-steers-per-request", self.max_steers_per_request),
                        ("--max-steer-rank", self.max_steer_rank)):
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
                raise ValueError(f"{flag}={v!r}: must be a positive integer")
            if v is not None and v > MAX_COUNT_FLAG:
                raise ValueError(f"{flag}={v}: over the limit of {MAX_COUNT_FLAG}; give the "
                                 "steers (or the rank) the server will really hold")
        if self.max_steers is not None and self.max_steers < len(self.steers):
            raise ValueError(f"--max-steers={self.max_steers} is less than the "
                             f"{len(self.steers)} steers given with --steer; raise it")
        if self.backend not in ("auto", "reference", "torch", "triton"):
            raise ValueError(f"steer backend {self.backend!r}: choose auto, reference, torch "
                             "or triton")

    @property
    def capacity(self) -> int:
        """Steer slots: ``max_steers``, default the number of ``--steer``, at least 8."""
        return self.max_steers if self.max_steers is not None else max(len(self.steers), 8)

    def reserved_rank(self, startup_ranks=()) -> int:
        """The rank per steer (and per domain component) the steer bank reserves at start-up,
        the largest a steer loaded at run time may have: ``--max-steer-rank``, else the
        largest of :data:`DEFAULT_RESERVED_RANK` and the ranks of the ``--steer`` files'
        factors, domain components included (:func:`vllm_steer.format.factor_ranks`)."""
        if self.max_steer_rank is not None:
            return self.max_steer_rank
        return max([DEFAULT_RESERVED_RANK, *startup_ranks])

    def startup_placement(self) -> dict[str, tuple[int, int]]:
        """``{name: (bank_slot, load_id)}`` of the ``--steer`` steers: the one place their bank
        slots and load ids are issued. Both processes receive this configuration: the workers
        put each steer there when the model loads, and the engine core's registry records the
        same placement and issues the next load ids after these."""
        return {name: (i, i + 1) for i, name in enumerate(self.steers)}

    @property
    def per_request(self) -> int:
        """The most steers one request may be served with (``--max-steers-per-request``)."""
        return (self.max_steers_per_request if self.max_steers_per_request is not None
                else DEFAULT_MAX_STEERS_PER_REQUEST)

    @property
    def enabled(self) -> bool:
        """Whether steering is on: steers given, a steer directory, run-time updates, or a
        capacity (offline: ``{"max_steers": 8}`` with no steers, to load them later)."""
        return bool(self.steers or self.steer_dir or self.enable_updates
                    or self.max_steers is not None)

    def layers_enabled(self) -> bool:
        """Whether the decoder layers get the op of decoder-layer steers (vector steers):
        ``--steer-vectors``, or a ``--steer`` file of such a kind (read from its header)."""
        if self.steer_vectors:
            return True
        from vllm_steer.kinds import AT_DECODER_LAYERS, kind_of_file

        for path in self.steers.values():
            try:
                if kind_of_file(path).applied_at == AT_DECODER_LAYERS:
                    return True
            except Exception:  # noqa: BLE001 - a bad file is refused with its reasons later
                continue
        return False

    @property
    def presets_change(self) -> bool:
        """Whether presets may change while the server runs (``--enable-steer-updates`` or
        ``--steer-presets-file``): a model name that is not static is then read from the
        engine core's preset table."""
        return bool(self.enable_updates or self.presets_file)

    def to_additional_config(self) -> dict[str, Any]:
        d = asdict(self)
        for k in _RUNTIME_KEYS:  # run-time management keys only when set
            if d.get(k) in (None, False):
                d.pop(k, None)
        if d.get("steer_drafter", True) is True:  # the default is not written
            d.pop("steer_drafter", None)
        for k in _POLICY_KEYS:  # presets, defaults, floors only when set
            if not d.get(k):
                d.pop(k, None)
        return {ADDITIONAL_CONFIG_KEY: d}

    @classmethod
    def from_additional_config(cls, additional_config: Mapping[str, Any] | None
                               ) -> "SteerServerConfig | None":
        if not additional_config or ADDITIONAL_CONFIG_KEY not in additional_config:
            return None
        d = dict(additional_config[ADDITIONAL_CONFIG_KEY])
        unknown = (set(d) - {"steers", "max_strength", "backend", "steer_drafter"}
                   - _RUNTIME_KEYS - _POLICY_KEYS)
        if unknown:
            raise ValueError(f"additional_config[{ADDITIONAL_CONFIG_KEY!r}] has unknown keys "
                             f"{sorted(unknown)}; known: steers, max_strength, backend, "
                             "steer_drafter, "
                             f"{', '.join(sorted(_RUNTIME_KEYS | _POLICY_KEYS))}")
        steers = d.get("steers") or {}
        if isinstance(steers, (list, tuple)):
            steers = dict(parse_steer_arg(s) for s in steers)
        return cls(steers=dict(steers), max_strength=d.get("max_strength", DEFAULT_MAX_STRENGTH),
                   backend=d.get("backend", "auto"),
                   steer_drafter=bool(d.get("steer_drafter", True)),
                   **{k: d[k] for k in _RUNTIME_KEYS if k in d},
                   **_policy_fields(d))


#: Keys of the run-time steer management (issue 15) in ``additional_config["vllm_steer"]``.
_RUNTIME_KEYS = frozenset({"max_steers", "max_steers_per_request", "max_steer_rank",
                           "steer_dir", "enable_updates", "updates_any_path", "presets_file",
                           "steer_vectors"})


#: Keys of the operator policy (issue 24: presets, defaults, floors; see vllm_steer.policy).
_POLICY_KEYS = frozenset({"presets", "defaults", "floors"})


def _policy_fields(d: Mapping[str, Any]) -> dict[str, Any]:
    """Presets, defaults and floors from ``additional_config`` (offline: the mix may also be
    the flag's string form, ``{"presets": {"polite": "detox:4"}}``)."""
    out: dict[str, Any] = {}
    presets = d.get("presets") or {}
    if presets:
        if not isinstance(presets, Mapping):
            raise ValueError("additional_config presets: expected a mapping preset name -> "
                             "{steer: strength} (or 'steer:strength,...')")
        out["presets"] = {}
        for n, m in presets.items():
            if isinstance(m, str):
                out["presets"][n] = parse_mix(m, "presets", f"{n}={m}")
            elif isinstance(m, Mapping):
                out["presets"][n] = {k: strength_value(f"additional_config presets {n}", k, v)
                                     for k, v in m.items()}
            else:
                raise ValueError(f"additional_config presets {n}: expected a mapping steer -> "
                                 f"strength (or 'steer:strength,...'), got {echo(m)}")
    for k in ("defaults", "floors"):
        v = d.get(k) or {}
        if v:
            if not isinstance(v, Mapping):
                raise ValueError(f"additional_config {k}: expected a mapping steer -> strength")
            out[k] = {n: strength_value(f"additional_config {k}", n, s) for n, s in v.items()}
    return out


def parse_steer_arg(arg: str) -> tuple[str, str]:
    """``NAME=PATH`` -> (NAME, PATH); ``PATH`` alone takes the name from the file's metadata."""
    if "=" in arg and not os.path.exists(arg):
        name, path = arg.split("=", 1)
        name = name.strip()
        problem = steer_name_problem(name)
        if problem:
            raise ValueError(f"--steer {echo(arg, 80)}: {problem} (use NAME=PATH)")
        return name, path
    from vllm_steer.kinds import read_any_metadata

    return read_any_metadata(arg).name, arg


# ---- the steer admin key (--steer-admin-key) -----------------------------------------------
#: The environment variable read when ``--steer-admin-key`` is not given (as vLLM reads
#: ``VLLM_API_KEY`` when ``--api-key`` is not given).
ADMIN_KEY_ENV = "VLLM_STEER_ADMIN_KEY"


class SecretKey(str):
    """A key given on the command line: a ``str`` whose ``repr`` hides it, so that vLLM's log
    of the non-default arguments (``non-default args: {...}``) shows ``'***'``. The key itself
    is never put in ``additional_config`` (vLLM logs the engine configuration)."""

    def __repr__(self) -> str:
        return "'***'"


def admin_key(args: Any = None) -> str | None:
    """The steer admin key: ``--steer-admin-key`` if given (``args.steer_admin_key``), else
    ``$VLLM_STEER_ADMIN_KEY``; None (or empty) when neither is set. With a key, the routes
    that change steers or presets (``POST /v1/steers``, ``DELETE /v1/steers/NAME``, ``POST
    /v1/steer-presets``, ``PUT`` and ``DELETE /v1/steer-presets/NAME``) need it as
    ``Authorization: Bearer KEY`` (:mod:`vllm_steer.server.admin`)."""
    key = getattr(args, "steer_admin_key", None) if args is not None else None
    return str(key) if key else (os.environ.get(ADMIN_KEY_ENV) or None)
