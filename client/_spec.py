"""`JobSpec` and `Role`: what a job runs, on how many nodes, and how its failures are treated.

Their normalisation (`__post_init__`), their checks (`validate`, naming the bad field in a
`SpecError`) and the JSON form of a job's roles (`roles_from_json`).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import Any, cast

from client._spec_fields import (
    _ENV_NAME,
    _FUNCTION_REF,
    _MODULE_NAME,
    _NAME,
    MAX_ARGV_ITEMS,
    MAX_ENV_ITEMS,
    MAX_FUNCTION_ARGS_BYTES,
    MAX_NODES,
    MAX_NPROC_PER_NODE,
    MAX_PRELOAD,
    MAX_RESTARTS,
    MAX_ROLES,
    MAX_SPEC_BYTES,
    MAX_STANDBY_LINGER_S,
    MAX_STRING,
    RESULT_KEY_BYTES,
    STALL_ACTIONS,
    SpecError,
    _count,
    _cut,
    _seconds,
    is_host,
    parse_restart_policy,
    parse_std_mapping,
    std_form,
)
from client._spec_function import (
    _UNBOUND,
    _check_main_path,
    _check_picklable,
    _function_entrypoint,
)


@dataclass(frozen=True)
class Role:
    """One role of a multi-role job (e.g. parameter servers and trainers): what its workers run
    and on how many nodes. Every node of a round runs the group of one role.

    The entrypoint is a command (argv); function entrypoints are for single-role jobs.
    """

    name: str
    """ROLE_NAME of this role's workers: 1-128 of [A-Za-z0-9_.-], unique in the job."""
    entrypoint: Sequence[str] | str = ()
    """Command argv (a string is one program name)."""
    args: Sequence[str] = ()
    """Extra argv appended to the command."""
    env: Mapping[str, str] = field(default_factory=dict)
    """Environment of this role's workers, over the job's `env`."""
    nproc_per_node: int = 1
    """Workers per node of this role (its LOCAL_WORLD_SIZE)."""
    min_nodes: int = 1
    """Fewest nodes of this role a round forms with."""
    max_nodes: int = 1
    """Most nodes of this role in a round."""

    def __post_init__(self) -> None:
        ep = self.entrypoint
        if isinstance(ep, str):
            object.__setattr__(self, "entrypoint", (ep,))
        elif isinstance(ep, Sequence):
            object.__setattr__(self, "entrypoint", tuple(ep))
        if isinstance(self.args, Sequence) and not isinstance(self.args, str):
            object.__setattr__(self, "args", tuple(self.args))
        if isinstance(self.env, Mapping):
            object.__setattr__(self, "env", dict(self.env))

    def validate(self, index: int, job_env: Mapping[str, str]) -> None:
        """Raise SpecError naming the bad field as ``roles[index].field``."""
        at = f"roles[{index}]"
        if not isinstance(self.name, str) or not _NAME.fullmatch(self.name):
            raise SpecError(f"{at}.name", f"must be 1-128 of [A-Za-z0-9_.-], got {self.name!r:.80}")
        ep = self.entrypoint
        if not isinstance(ep, tuple) or not ep:
            raise SpecError(
                f"{at}.entrypoint",
                "must be a non-empty command (a role runs a command; function entrypoints are "
                "for single-role jobs)",
            )
        if not isinstance(self.args, tuple):
            raise SpecError(f"{at}.args", "must be a list of strings")
        argv = ep + self.args
        if len(argv) > MAX_ARGV_ITEMS:
            raise SpecError(f"{at}.args", f"at most {MAX_ARGV_ITEMS} items, got {len(argv)}")
        for i, a in enumerate(argv):
            where = f"{at}.entrypoint" if i < len(ep) else f"{at}.args"
            if not isinstance(a, str) or "\x00" in a or len(a) > MAX_STRING:
                raise SpecError(where, f"item {i} is not a valid argument")
        if not ep[0]:
            raise SpecError(f"{at}.entrypoint", "the program name must not be empty")
        if not isinstance(self.env, dict):
            raise SpecError(f"{at}.env", "must be a mapping of strings")
        if len(self.env) > MAX_ENV_ITEMS or len({*self.env, *job_env}) > MAX_ENV_ITEMS:
            raise SpecError(
                f"{at}.env", f"at most {MAX_ENV_ITEMS} variables with the job's env together"
            )
        for k, v in self.env.items():
            if not isinstance(k, str) or not _ENV_NAME.fullmatch(k):
                raise SpecError(
                    f"{at}.env", f"invalid variable name {k!r:.80} (letters, digits, _; no '=')"
                )
            if not isinstance(v, str) or "\x00" in v or len(v) > MAX_STRING:
                raise SpecError(f"{at}.env", f"invalid value for {k}")
        _count(f"{at}.nproc_per_node", self.nproc_per_node, 1, MAX_NPROC_PER_NODE)
        _count(f"{at}.min_nodes", self.min_nodes, 1, MAX_NODES)
        _count(f"{at}.max_nodes", self.max_nodes, 1, MAX_NODES)
        if self.min_nodes > self.max_nodes:
            raise SpecError(
                f"{at}.min_nodes",
                f"must be <= max_nodes (got {self.min_nodes} > {self.max_nodes})",
            )


_ROLE_KEYS = frozenset(f.name for f in fields(Role))


def roles_from_json(text: str | bytes) -> tuple[Role, ...]:
    """The roles of a JSON document: a list of objects with Role's fields, e.g.
    ``[{"name": "ps", "entrypoint": ["python", "ps.py"], "nproc_per_node": 1},
    {"name": "trainer", "entrypoint": ["python", "train.py"], "min_nodes": 1, "max_nodes": 2}]``.

    SpecError names the bad field (``roles[1].nproc_per_node``); the roles are then checked
    by `JobSpec.validate`.
    """
    if len(text) > MAX_SPEC_BYTES:
        raise SpecError("roles", f"the roles document is over {MAX_SPEC_BYTES} bytes")
    try:
        doc = json.loads(text)
    except (ValueError, UnicodeDecodeError) as exc:
        raise SpecError("roles", f"not valid JSON: {_cut(str(exc))}") from None
    if not isinstance(doc, list) or not doc:
        raise SpecError("roles", "must be a non-empty JSON list of role objects")
    if len(doc) > MAX_ROLES:
        raise SpecError("roles", f"at most {MAX_ROLES} roles, got {len(doc)}")
    out: list[Role] = []
    for i, item in enumerate(doc):
        if not isinstance(item, dict):
            raise SpecError(f"roles[{i}]", "must be a JSON object")
        for key in item:
            if key not in _ROLE_KEYS:
                raise SpecError(f"roles[{i}].{str(key)[:40]}", "unknown field")
        if "name" not in item:
            raise SpecError(f"roles[{i}].name", "missing")
        for key in ("entrypoint", "args"):
            value = item.get(key, [])
            if not isinstance(value, list | str):
                raise SpecError(f"roles[{i}].{key}", "must be a list of strings")
        env = item.get("env", {})
        if not isinstance(env, dict):
            raise SpecError(f"roles[{i}].env", "must be an object of strings")
        out.append(Role(**item))
    return tuple(out)


@dataclass(frozen=True)
class JobSpec:
    """What to run, on how many nodes, and how to treat failures.

    `entrypoint` is a command (a list of argv, e.g. ``["python", "train.py"]``), a function
    reference ``"pkg.module:function"``, or an importable callable. For a function, `args` and
    `kwargs` are pickled by the client and unpickled only inside the worker.
    """

    entrypoint: Sequence[str] | str | Callable[..., Any] = ()
    """Command argv, or a function reference / importable callable."""
    args: Sequence[Any] = ()
    """Extra argv for a command; positional arguments for a function."""
    kwargs: Mapping[str, Any] = field(default_factory=dict)
    """Keyword arguments for a function entrypoint."""
    nproc_per_node: int = 1
    """Workers per node (torchrun's --nproc-per-node, local_world_size)."""
    min_nodes: int = 1
    """Smallest number of nodes the job runs on."""
    max_nodes: int = 1
    """Largest number of nodes; the round closes at once when this many are free."""
    max_restarts: int = 0
    """Failure restarts allowed for the whole job (membership changes do not count)."""
    role: str = "default"
    """ROLE_NAME of the workers."""
    name: str = ""
    """A label for people; the coordinator makes the job id."""
    env: Mapping[str, str] = field(default_factory=dict)
    """Extra environment for every worker."""
    redirects: str = "0"
    """torchrun --redirects: 0 none, 1 stdout, 2 stderr, 3 both; or "0:3,1:1". torch's `Std`,
    an int or a `{local_rank: Std}` dict are accepted too and kept in this string form."""
    tee: str = "0"
    """torchrun --tee: like redirects, but also printed by the agent with a prefix."""
    join_timeout: float = 600.0
    """Seconds a job waits for min_nodes free nodes before it fails."""
    last_call_timeout: float = 30.0
    """Seconds a round waits for more nodes once min_nodes are there (0 = close at once)."""
    exit_barrier_timeout: float = 300.0
    """Seconds nodes that finished wait for the others before being released."""
    stop_grace: float = 30.0
    """Seconds between SIGTERM and SIGKILL when workers are stopped."""
    restart_backoff: float = 0.0
    """Seconds to wait before a failure restart (each wait drawn from [0.5, 1.5] of it)."""
    restart_policy: str = ""
    """Which failures restart the job. "" (the default): every one but an input error, which no
    restart mends and which fails the job at once, saying why (a SyntaxError, an ImportError of
    the entrypoint's own imports, a script or program that does not exist, an exit 2 with an
    argparse-style usage error); "always": every failure, input errors too; or exit codes
    ("2,127") that fail the job at once besides the input errors (Kubeflow's ExitCode policy)."""
    scale_up: str = "restart"
    """"restart": re-form when a node joins below max_nodes; "never": keep running."""
    watchdog: bool = False
    """Serve torch's FileTimer protocol at TORCHELASTIC_TIMER_FILE."""
    torch_metrics: bool = False
    """What the workers report through torch.distributed.elastic.metrics (`put_metric`, `prof`,
    `publish_metric`) reaches the coordinator's Prometheus metrics, as
    `gelastic_torch_metric{job,group,name}` (bounded: see docs/extending.md)."""
    cwd: str = ""
    """Working directory of the workers ("" = the agent's)."""
    stderr_tail_lines: int = 50
    """Lines of stderr attached to a failure without an error file."""
    unhealthy_timeout: float = 60.0
    """Seconds a worker may stay in uninterruptible sleep or stopped before it is a failure."""
    stall_timeout: float = 0.0
    """Seconds without a step (`client.progress`) after which the job is stalled: no rank's step
    advanced for that long, or some ranks' did while others' did not (those are behind).
    Without progress reports, every rank idle on the CPU for that long. 0 (the default): off."""
    stall_action: str = "report"
    """What a stall does: "report" (an event and the job's status say so; it keeps running),
    "restart" (a HANG failure of the ranks behind: the job restarts as after a crash) or
    "fail" (the job fails at once)."""
    straggler_factor: float = 1.5
    """A rank whose steps/s stays under the median rank's divided by this is a straggler."""
    straggler_window: float = 60.0
    """Seconds a rank must stay that slow before it is flagged a straggler."""
    function: str = field(default="", repr=False)
    """Internal: set from `entrypoint` when it names a function; "pkg.module:qualname"."""
    main_path: str = ""
    """For a function of the submitter's main script ("__main__:fn"): that script's path on the
    nodes (absolute, or relative to `cwd`). Set from `entrypoint` when it is such a function."""
    function_args: bytes = field(default=b"", repr=False)
    """Internal: pickled (args, kwargs) of a function entrypoint, as sent over the wire."""
    result_key: bytes = field(default=b"", repr=False)
    """Internal, function entrypoints: the key the workers tag their return values with. Made by
    `Client.submit`; a secret of the submitter and the job's workers, never shown."""
    preload: tuple[str, ...] = ()
    """Modules (e.g. ``("torch",)``) that warm standby interpreters import before their round;
    empty (the default) starts every worker cold. See docs/python-api.md, "Standby workers"."""
    standby_linger: float = 0.0
    """Seconds the standbys (and warm store host) of a job that succeeded stay on each node for
    the next job of the very same spec (a sweep); 0 (the default) kills them with the job."""
    master_addr: str = ""
    """A fixed MASTER_ADDR for every round ("" = group rank 0's node address), e.g. the
    interface to use on a multi-homed host; the round's c10d store listens there."""
    master_port: int = 0
    """A fixed MASTER_PORT for every round (0 = a free port group rank 0 reserves per round),
    e.g. one a firewall lets through. If it is taken, the round fails naming it."""
    wait_for_nodes: bool = False
    """More nodes are on their way: wait (up to `join_timeout`) for a node big enough for one
    group of the job to join, even when no node the coordinator knows could ever hold one, and
    keep a range round open for its whole last call even when every live node with room has
    joined. False (the default) fails a job no known node could hold at once, saying which
    node is the largest, and closes a round once every live node with room is in. A multi-node
    `gelastic run` sets it: its nodes' launchers arrive one by one."""
    roles: tuple[Role, ...] = ()
    """Several roles in one rendezvous and one world (e.g. parameter servers and trainers);
    empty (the default) is one role made of `role`, `entrypoint`, `nproc_per_node` and
    `min_nodes..max_nodes`. With roles, leave `entrypoint`/`args`/`kwargs` empty:
    `min_nodes`/`max_nodes` become the sums of the roles' and `nproc_per_node` the largest.
    See docs/python-api.md, "Multi-role jobs"."""

    def __post_init__(self) -> None:
        if not isinstance(self.roles, tuple) and isinstance(self.roles, Sequence):
            object.__setattr__(self, "roles", tuple(self.roles))
        if self.roles and all(isinstance(r, Role) for r in self.roles):
            counts = [(r.min_nodes, r.max_nodes, r.nproc_per_node) for r in self.roles]
            if all(isinstance(x, int) and not isinstance(x, bool) for c in counts for x in c):
                object.__setattr__(self, "min_nodes", sum(c[0] for c in counts))
                object.__setattr__(self, "max_nodes", sum(c[1] for c in counts))
                object.__setattr__(self, "nproc_per_node", max(c[2] for c in counts))
        ep = self.entrypoint
        if callable(ep):
            ref, main_path, bound_self = _function_entrypoint(ep)
            object.__setattr__(self, "function", ref)
            object.__setattr__(self, "entrypoint", ())
            if main_path and not self.main_path:
                object.__setattr__(self, "main_path", main_path)
            if bound_self is not _UNBOUND:  # obj.method runs as Class.method(obj, *args)
                object.__setattr__(self, "args", (bound_self, *tuple(self.args)))
        elif isinstance(ep, str):
            if _FUNCTION_REF.fullmatch(ep):
                object.__setattr__(self, "function", ep)
                object.__setattr__(self, "entrypoint", ())
            else:
                object.__setattr__(self, "entrypoint", (ep,))
        else:
            object.__setattr__(self, "entrypoint", tuple(ep))
        if not self.function:
            object.__setattr__(self, "args", tuple(self.args))
        elif not self.function_args:  # not yet pickled by submit(): say now what cannot be
            _check_picklable(self.function, self.args, self.kwargs)
        object.__setattr__(self, "env", dict(self.env))
        object.__setattr__(self, "preload", tuple(self.preload))
        object.__setattr__(self, "kwargs", dict(self.kwargs))
        for name in ("redirects", "tee"):
            form = std_form(getattr(self, name))
            if form is not None:
                object.__setattr__(self, name, form)
        addr = self.master_addr
        if isinstance(addr, str) and addr.startswith("[") and addr.endswith("]"):
            object.__setattr__(self, "master_addr", addr[1:-1])

    def __repr__(self) -> str:
        # The public fields only; a function entrypoint shows as the reference it was given.
        parts = []
        for f in fields(self):
            if not f.repr:
                continue
            value = getattr(self, f.name)
            if f.name == "entrypoint" and self.function:
                value = self.function
            parts.append(f"{f.name}={value!r}")
        return f"JobSpec({', '.join(parts)})"

    @property
    def is_function(self) -> bool:
        return bool(self.function)

    @property
    def command(self) -> tuple[str, ...]:
        """The command entrypoint, as normalised by __post_init__ (empty for a function)."""
        return cast(tuple[str, ...], self.entrypoint)

    @property
    def argv(self) -> tuple[str, ...]:
        """The full command of a command entrypoint."""
        return self.command + tuple(str(a) for a in self.args)

    def role_named(self, name: str) -> Role | None:
        """The role of this name (None when there is none, or the job has one role)."""
        return next((r for r in self.roles if r.name == name), None)

    def for_role(self, name: str) -> JobSpec:
        """The single-role spec that a node of role `name` runs: the role's command, workers
        per node and node counts, the job's env with the role's over it, ROLE_NAME = `name`.
        A single-role spec gives itself for its own role; SpecError for any other name."""
        if not self.roles:
            if name != self.role:
                raise SpecError("role", f"the job has no role {name!r:.80}")
            return self
        role = self.role_named(name)
        if role is None:
            raise SpecError("roles", f"the job has no role {name!r:.80}")
        return dataclasses.replace(
            self,
            roles=(),
            entrypoint=role.entrypoint,
            args=role.args,
            env={**self.env, **role.env},
            nproc_per_node=role.nproc_per_node,
            min_nodes=role.min_nodes,
            max_nodes=role.max_nodes,
            role=role.name,
        )

    def _validate_roles(self) -> None:
        if not isinstance(self.roles, tuple):
            raise SpecError("roles", "must be a list of Role")
        if len(self.roles) > MAX_ROLES:
            raise SpecError("roles", f"at most {MAX_ROLES} roles, got {len(self.roles)}")
        if self.entrypoint or self.function or self.args or self.kwargs:
            raise SpecError(
                "entrypoint", "with roles, give each role its entrypoint and args, not the job"
            )
        seen: set[str] = set()
        for i, r in enumerate(self.roles):
            if not isinstance(r, Role):
                raise SpecError(f"roles[{i}]", f"must be a Role, got {type(r).__name__}")
            r.validate(i, self.env)
            if r.name in seen:
                raise SpecError(f"roles[{i}].name", f"role {r.name!r} is given twice")
            seen.add(r.name)
        # Every role's nodes are distinct nodes of one round: the sums must fit together.
        if sum(r.max_nodes for r in self.roles) > MAX_NODES:
            raise SpecError("roles", f"the roles' max_nodes add up to more than {MAX_NODES} nodes")

    def validate(self) -> None:
        """Raise SpecError naming the first bad field."""
        if self.roles:
            self._validate_roles()
        elif self.function and self.entrypoint:
            raise SpecError("entrypoint", "give a command or a function, not both")
        elif not self.function:
            if not self.entrypoint:
                raise SpecError("entrypoint", "must not be empty")
            argv = self.argv
            if len(argv) > MAX_ARGV_ITEMS:
                raise SpecError("args", f"at most {MAX_ARGV_ITEMS} items, got {len(argv)}")
            for i, a in enumerate(argv):
                if not isinstance(a, str):
                    raise SpecError("entrypoint", f"item {i} must be a string, got {a!r}")
                if "\x00" in a or len(a) > MAX_STRING:
                    raise SpecError("entrypoint", f"item {i} is not a valid argument")
            if not self.command[0]:
                raise SpecError("entrypoint", "the program name must not be empty")
        elif not _FUNCTION_REF.fullmatch(self.function):
            raise SpecError(
                "entrypoint", f"not a function reference 'pkg.module:name': {self.function!r}"
            )
        _check_main_path(self.function, self.main_path)
        if len(self.function_args) > MAX_FUNCTION_ARGS_BYTES:
            raise SpecError(
                "args",
                f"pickled arguments are {len(self.function_args)} bytes, "
                f"over the limit of {MAX_FUNCTION_ARGS_BYTES}",
            )
        if self.result_key and (not self.function or len(self.result_key) != RESULT_KEY_BYTES):
            raise SpecError(
                "result_key",
                f"must be {RESULT_KEY_BYTES} bytes, and only for a function entrypoint",
            )
        _count("nproc_per_node", self.nproc_per_node, 1, MAX_NPROC_PER_NODE)
        _count("min_nodes", self.min_nodes, 1, MAX_NODES)
        _count("max_nodes", self.max_nodes, 1, MAX_NODES)
        if self.min_nodes > self.max_nodes:
            raise SpecError(
                "min_nodes", f"must be <= max_nodes (got {self.min_nodes} > {self.max_nodes})"
            )
        _count("max_restarts", self.max_restarts, 0, MAX_RESTARTS)
        if not isinstance(self.role, str) or not _NAME.fullmatch(self.role):
            raise SpecError("role", f"must be 1-128 of [A-Za-z0-9_.-], got {self.role!r}")
        if not isinstance(self.name, str) or (self.name and not _NAME.fullmatch(self.name)):
            raise SpecError("name", f"must be 1-128 of [A-Za-z0-9_.-], got {self.name!r}")
        if len(self.env) > MAX_ENV_ITEMS:
            raise SpecError("env", f"at most {MAX_ENV_ITEMS} variables, got {len(self.env)}")
        for k, v in self.env.items():
            if not isinstance(k, str) or not _ENV_NAME.fullmatch(k):
                raise SpecError("env", f"invalid variable name {k!r} (letters, digits, _; no '=')")
            if not isinstance(v, str) or "\x00" in v or len(v) > MAX_STRING:
                raise SpecError("env", f"invalid value for {k}")
        parse_std_mapping("redirects", self.redirects, self.nproc_per_node)
        parse_std_mapping("tee", self.tee, self.nproc_per_node)
        _seconds("join_timeout", self.join_timeout, allow_zero=False)
        _seconds("last_call_timeout", self.last_call_timeout)
        _seconds("exit_barrier_timeout", self.exit_barrier_timeout)
        _seconds("stop_grace", self.stop_grace)
        _seconds("restart_backoff", self.restart_backoff)
        parse_restart_policy(self.restart_policy)
        _seconds("unhealthy_timeout", self.unhealthy_timeout, allow_zero=False)
        _seconds("stall_timeout", self.stall_timeout)
        if self.stall_action not in STALL_ACTIONS:
            raise SpecError(
                "stall_action",
                f"must be one of {', '.join(STALL_ACTIONS)}, got {self.stall_action!r:.80}",
            )
        if not isinstance(self.straggler_factor, int | float) or not (
            1.0 < self.straggler_factor <= 1000.0
        ):
            raise SpecError(
                "straggler_factor",
                f"must be a number in (1, 1000], got {self.straggler_factor!r:.80}",
            )
        _seconds("straggler_window", self.straggler_window)
        if self.scale_up not in ("restart", "never"):
            raise SpecError("scale_up", f"must be 'restart' or 'never', got {self.scale_up!r}")
        if not isinstance(self.cwd, str) or "\x00" in self.cwd or len(self.cwd) > 4096:
            raise SpecError("cwd", "invalid path")
        _count("stderr_tail_lines", self.stderr_tail_lines, 0, 10_000)
        if len(self.preload) > MAX_PRELOAD:
            raise SpecError("preload", f"at most {MAX_PRELOAD} modules, got {len(self.preload)}")
        for mod in self.preload:
            if not isinstance(mod, str) or not _MODULE_NAME.fullmatch(mod):
                raise SpecError("preload", f"not a module name: {str(mod)[:80]!r}")
        _seconds("standby_linger", self.standby_linger)
        if self.standby_linger > MAX_STANDBY_LINGER_S:
            raise SpecError(
                "standby_linger",
                f"must be at most {MAX_STANDBY_LINGER_S:.0f} s, got {self.standby_linger!r}",
            )
        if self.standby_linger and not self.preload:
            raise SpecError("standby_linger", "needs preload: a spec without it has no standbys")
        if not isinstance(self.master_addr, str) or (
            self.master_addr and not is_host(self.master_addr)
        ):
            raise SpecError(
                "master_addr", f"must be a host name or IP address, got {self.master_addr!r:.80}"
            )
        if self.master_port:
            _count("master_port", self.master_port, 1, 65535)
        elif isinstance(self.master_port, bool) or self.master_port != 0:
            raise SpecError("master_port", f"must be 1-65535 (or 0), got {self.master_port!r}")
