"""Translation between the generated protobuf messages and gelastic's domain types.

The one adapter module for both directions; every servicer and client call goes through it, so
no decision code ever sees a protobuf message.
"""

from __future__ import annotations

from typing import Any

from client.model import (
    MAX_ROLES,
    MAX_SPEC_BYTES,
    AttemptSummary,
    FailureCategory,
    GpuDevice,
    GpuHealth,
    JobEvent,
    JobSpec,
    JobState,
    JobStatus,
    Member,
    NodeInfo,
    ProcessFailure,
    Role,
    RunResult,
    SpecError,
    WorkerGpu,
    WorkerState,
    WorkerStatus,
)
from client.redaction import redact_argv, redact_env
from protos.gelastic.v1 import gelastic_pb2 as pb

__all__ = [
    "attempt_from_pb",
    "attempt_to_pb",
    "check_spec_size",
    "event_from_pb",
    "event_to_pb",
    "failure_from_pb",
    "failure_to_pb",
    "gpu_device_from_pb",
    "gpu_device_to_pb",
    "gpu_health_from_pb",
    "gpu_health_to_pb",
    "group_state_from_pb",
    "group_state_to_pb",
    "job_status_from_pb",
    "job_to_pb",
    "node_from_pb",
    "node_to_pb",
    "result_from_pb",
    "result_to_pb",
    "role_from_pb",
    "role_to_pb",
    "shown_spec",
    "spec_from_pb",
    "spec_to_pb",
]


def _ms(seconds: float) -> int:
    return round(seconds * 1000)


def _s(ms: int) -> float:
    return ms / 1000.0


_JOB_STATES = {s: getattr(pb, f"JOB_STATE_{s.value}") for s in JobState}
_JOB_STATES_BACK = {v: k for k, v in _JOB_STATES.items()}
_WORKER_STATES = {s: getattr(pb, f"WORKER_STATE_{s.value}") for s in WorkerState}
_WORKER_STATES_BACK = {v: k for k, v in _WORKER_STATES.items()}
_EXITED = (WorkerState.SUCCEEDED, WorkerState.FAILED, WorkerState.STOPPED)
_GROUP_STATES = {s: getattr(pb, f"GROUP_STATE_{s.value}") for s in WorkerState}
_GROUP_STATES_BACK = {v: k for k, v in _GROUP_STATES.items()}


def group_state_to_pb(state: WorkerState | None) -> int:
    """A worker group's state on the wire (GROUP_STATE_UNSPECIFIED: not known)."""
    return pb.GROUP_STATE_UNSPECIFIED if state is None else int(_GROUP_STATES[state])


def group_state_from_pb(value: int) -> WorkerState | None:
    """A worker group's state from the wire (None: not reported, or a value we do not know)."""
    return _GROUP_STATES_BACK.get(value)


_CATEGORIES = {c: getattr(pb, f"FAILURE_CATEGORY_{c.value}") for c in FailureCategory}
_CATEGORIES_BACK = {v: k for k, v in _CATEGORIES.items()}


def spec_to_pb(spec: JobSpec) -> pb.JobSpec:
    """The wire form of a spec. Function arguments must already be pickled into function_args."""
    return pb.JobSpec(
        name=spec.name,
        role=spec.role,
        entrypoint=list(spec.command) if not spec.function else [],
        function=spec.function,
        main_path=spec.main_path,
        args=[str(a) for a in spec.args] if not spec.function else [],
        function_args=spec.function_args,
        nproc_per_node=spec.nproc_per_node,
        min_nodes=spec.min_nodes,
        max_nodes=spec.max_nodes,
        max_restarts=spec.max_restarts,
        env=dict(spec.env),
        redirects=spec.redirects,
        tee=spec.tee,
        join_timeout_ms=_ms(spec.join_timeout),
        last_call_timeout_ms=_ms(spec.last_call_timeout),
        exit_barrier_timeout_ms=_ms(spec.exit_barrier_timeout),
        stop_grace_ms=_ms(spec.stop_grace),
        restart_backoff_ms=_ms(spec.restart_backoff),
        scale_up=spec.scale_up,
        watchdog=spec.watchdog,
        torch_metrics=spec.torch_metrics,
        cwd=spec.cwd,
        stderr_tail_lines=spec.stderr_tail_lines,
        unhealthy_timeout_ms=_ms(spec.unhealthy_timeout),
        result_key=spec.result_key,
        preload=list(spec.preload),
        standby_linger_ms=_ms(spec.standby_linger),
        master_addr=spec.master_addr,
        master_port=spec.master_port,
        roles=[role_to_pb(r) for r in spec.roles],
        wait_for_nodes=spec.wait_for_nodes,
        restart_policy=spec.restart_policy,
        stall_timeout_ms=_ms(spec.stall_timeout),
        stall_action=spec.stall_action,
        straggler_factor=spec.straggler_factor,
        straggler_window_ms=_ms(spec.straggler_window),
    )


def role_to_pb(r: Role) -> pb.Role:
    return pb.Role(
        name=r.name,
        entrypoint=list(r.entrypoint),
        args=[str(a) for a in r.args],
        env=dict(r.env),
        nproc_per_node=r.nproc_per_node,
        min_nodes=r.min_nodes,
        max_nodes=r.max_nodes,
    )


def role_from_pb(m: pb.Role) -> Role:
    return Role(
        name=m.name,
        entrypoint=tuple(m.entrypoint),
        args=tuple(m.args),
        env=dict(m.env),
        nproc_per_node=m.nproc_per_node,
        min_nodes=m.min_nodes,
        max_nodes=m.max_nodes,
    )


def check_spec_size(spec: JobSpec) -> int:
    """The size of the spec's wire form; SpecError naming the biggest field when it is over
    MAX_SPEC_BYTES.

    The wire form is what every assignment and every job with its spec carries, so the limit is
    on it and not on any one field: many fields each under their own limit add up.
    """
    total = spec_to_pb(spec).ByteSize()
    if total <= MAX_SPEC_BYTES:
        return total
    # Each piece as it is encoded (tag, length and bytes), to name the one to shrink.
    sizes = {
        "env": sum(pb.JobSpec(env={k: v}).ByteSize() for k, v in spec.env.items()),
        "function_args": pb.JobSpec(function_args=spec.function_args).ByteSize(),
    }
    if not spec.function:
        sizes["entrypoint"] = sum(pb.JobSpec(entrypoint=[a]).ByteSize() for a in spec.command)
        sizes["args"] = sum(pb.JobSpec(args=[str(a)]).ByteSize() for a in spec.args)
    for i, r in enumerate(spec.roles):
        sizes[f"roles[{i}]"] = pb.JobSpec(roles=[role_to_pb(r)]).ByteSize()
    biggest = max(sizes, key=lambda k: sizes[k])
    what = "pickled arguments (function_args)" if biggest == "function_args" else biggest
    raise SpecError(
        biggest,
        f"the encoded spec is {total:,} bytes, over the limit of {MAX_SPEC_BYTES:,} "
        f"({what} takes {sizes[biggest]:,} of them)",
    )


def spec_from_pb(msg: pb.JobSpec) -> JobSpec:
    """A domain spec from the wire; unset optional fields take the domain defaults.

    Not validated here: the caller validates, so the error names the field.
    """
    d = JobSpec()

    def opt_s(name: str, default: float) -> float:
        return _s(getattr(msg, name)) if msg.HasField(name) else default

    def opt_i(name: str, default: int) -> int:
        return int(getattr(msg, name)) if msg.HasField(name) else default

    entrypoint: tuple[str, ...] | str = msg.function if msg.function else tuple(msg.entrypoint)
    return JobSpec(
        entrypoint=entrypoint,
        args=() if msg.function else tuple(msg.args),
        main_path=msg.main_path,
        nproc_per_node=opt_i("nproc_per_node", d.nproc_per_node),
        min_nodes=opt_i("min_nodes", d.min_nodes),
        max_nodes=opt_i("max_nodes", d.max_nodes),
        max_restarts=msg.max_restarts,
        role=msg.role or d.role,
        name=msg.name,
        env=dict(msg.env),
        redirects=msg.redirects or "0",
        tee=msg.tee or "0",
        join_timeout=opt_s("join_timeout_ms", d.join_timeout),
        last_call_timeout=opt_s("last_call_timeout_ms", d.last_call_timeout),
        exit_barrier_timeout=opt_s("exit_barrier_timeout_ms", d.exit_barrier_timeout),
        stop_grace=opt_s("stop_grace_ms", d.stop_grace),
        restart_backoff=opt_s("restart_backoff_ms", d.restart_backoff),
        scale_up=msg.scale_up or d.scale_up,
        watchdog=msg.watchdog,
        torch_metrics=msg.torch_metrics,
        cwd=msg.cwd,
        stderr_tail_lines=opt_i("stderr_tail_lines", d.stderr_tail_lines),
        unhealthy_timeout=opt_s("unhealthy_timeout_ms", d.unhealthy_timeout),
        function_args=msg.function_args,
        result_key=msg.result_key,
        preload=tuple(msg.preload),
        standby_linger=msg.standby_linger_ms / 1000,
        master_addr=msg.master_addr,
        master_port=msg.master_port,
        roles=tuple(role_from_pb(r) for r in msg.roles[: MAX_ROLES + 1]),
        wait_for_nodes=msg.wait_for_nodes,
        restart_policy=msg.restart_policy[:200],
        stall_timeout=msg.stall_timeout_ms / 1000,
        stall_action=msg.stall_action[:40] or d.stall_action,
        straggler_factor=(
            msg.straggler_factor if msg.HasField("straggler_factor") else d.straggler_factor
        ),
        straggler_window=opt_s("straggler_window_ms", d.straggler_window),
    )


def failure_to_pb(f: ProcessFailure) -> pb.ProcessFailure:
    return pb.ProcessFailure(
        node=f.node,
        global_rank=f.global_rank,
        local_rank=f.local_rank,
        pid=f.pid,
        exitcode=f.exitcode,
        signal=f.signal,
        error_file=f.error_file,
        message=f.message,
        traceback=f.traceback,
        timestamp=f.precise_timestamp,
        attempt=f.attempt,
        round=f.round,
        root_cause=f.root_cause,
        category=_CATEGORIES[f.category],
        stderr_tail=f.stderr_tail,
        role_rank=f.role_rank,
        role=f.role,
        clock_offset=f.clock_offset,
        time_uncertainty=f.time_uncertainty,
        executable=f.executable,
        detail=f.detail,
    )


def failure_from_pb(m: pb.ProcessFailure) -> ProcessFailure:
    return ProcessFailure(
        global_rank=m.global_rank,
        local_rank=m.local_rank,
        pid=m.pid,
        exitcode=m.exitcode,
        message=m.message,
        timestamp=m.timestamp,
        node=m.node,
        signal=m.signal,
        error_file=m.error_file or "<N/A>",
        traceback=m.traceback,
        attempt=m.attempt,
        round=m.round,
        root_cause=m.root_cause,
        category=_CATEGORIES_BACK.get(m.category, FailureCategory.USER),
        stderr_tail=m.stderr_tail,
        role=m.role,
        role_rank=m.role_rank,
        clock_offset=m.clock_offset,
        time_uncertainty=m.time_uncertainty,
        executable=m.executable,
        detail=m.detail,
    )


def attempt_to_pb(a: AttemptSummary) -> pb.AttemptSummary:
    return pb.AttemptSummary(
        attempt=a.attempt,
        round=a.round,
        nodes=list(a.nodes),
        end_reason=a.end_reason,
        failures=[failure_to_pb(f) for f in a.failures],
        started_at=a.started_at,
        ended_at=a.ended_at,
    )


def attempt_from_pb(m: pb.AttemptSummary) -> AttemptSummary:
    return AttemptSummary(
        attempt=m.attempt,
        round=m.round,
        nodes=tuple(m.nodes),
        end_reason=m.end_reason,
        failures=tuple(failure_from_pb(f) for f in m.failures),
        started_at=m.started_at,
        ended_at=m.ended_at,
    )


def result_to_pb(r: RunResult) -> pb.RunResult:
    """The summary of a result: return values by size only; their bytes travel by GetResult."""
    root = r.root_cause
    sizes = {int(k): len(v) for k, v in r.return_values.items() if isinstance(v, bytes)}
    return pb.RunResult(
        state=_WORKER_STATES[r.state],
        return_value_sizes=sizes or {int(k): int(v) for k, v in r.return_value_sizes.items()},
        failures={int(k): failure_to_pb(f) for k, f in r.failures.items()},
        root_cause_rank=root.global_rank if root is not None else -1,
        attempts=[attempt_to_pb(a) for a in r.attempts],
        reason=r.reason,
    )


def result_from_pb(m: pb.RunResult, job_id: str = "", name: str = "") -> RunResult:
    """A result summary: no return values, only their sizes (the client fetches the bytes)."""
    return RunResult(
        state=_WORKER_STATES_BACK.get(m.state, WorkerState.UNKNOWN),
        return_value_sizes={int(k): int(v) for k, v in m.return_value_sizes.items()},
        failures={int(k): failure_from_pb(f) for k, f in m.failures.items()},
        attempts=tuple(attempt_from_pb(a) for a in m.attempts),
        reason=m.reason,
        job_id=job_id,
        name=name,
    )


def job_to_pb(status: JobStatus, result: RunResult | None, spec: JobSpec | None = None) -> pb.Job:
    msg = pb.Job(
        job_id=status.job_id,
        name=status.name,
        state=_JOB_STATES[status.state],
        reason=status.reason,
        attempt=status.attempt,
        round=status.round,
        max_restarts=status.max_restarts,
        members=[
            pb.Member(
                node=m.node,
                addr=m.addr,
                group_rank=m.group_rank,
                nproc=m.nproc,
                done=m.done,
                role=m.role,
                group_state=group_state_to_pb(m.group_state),  # type: ignore[arg-type]
            )
            for m in status.members
        ],
        workers=[
            pb.WorkerStatus(
                global_rank=w.global_rank,
                local_rank=w.local_rank,
                node=w.node,
                state=_WORKER_STATES[w.state],
                pid=w.pid,
                cpu_percent=w.cpu_percent,
                rss_bytes=w.rss_bytes,
                proc_state=w.proc_state,
                exitcode=w.exitcode if w.exitcode is not None else 0,
                role=w.role,
                role_rank=w.role_rank,
                world_size=w.world_size,
                role_world_size=w.role_world_size,
                gpu_index=w.gpu.index if w.gpu is not None else -1,
                gpu_uuid=w.gpu.uuid if w.gpu is not None else "",
                gpu_utilization_percent=w.gpu.utilization_percent if w.gpu is not None else 0.0,
                gpu_memory_used_bytes=w.gpu.memory_used if w.gpu is not None else 0,
                gpu_temperature_c=w.gpu.temperature_c if w.gpu is not None else 0,
                gpu_memory_total_bytes=w.gpu.memory_total if w.gpu is not None else 0,
                **_progress_to_pb(w),
            )
            for w in status.workers
        ],
        stall_reason=status.stall_reason,
        stalled_since=status.stalled_since,
        submitted_at=status.submitted_at,
        finished_at=status.finished_at,
        min_nodes=status.min_nodes,
        max_nodes=status.max_nodes,
        nodes_joined=status.nodes_joined,
        last_call_deadline=status.last_call_deadline,
        world_size=status.world_size,
    )
    if spec is not None:
        msg.spec.CopyFrom(_shown_spec_pb(spec))
        msg.spec.ClearField("result_key")  # a secret of the submitter and the workers
    if result is not None:
        msg.result.CopyFrom(result_to_pb(result))
        msg.has_result = True
    return msg


def _shown_spec_pb(spec: JobSpec) -> pb.JobSpec:
    """The spec as clients are shown it: env values, the values of secret-looking options and
    the pickled arguments withheld. Assignments to agents carry the whole spec (spec_to_pb)."""
    m = spec_to_pb(spec)
    if not spec.function:
        argv = redact_argv([*m.entrypoint, *m.args])
        n = len(m.entrypoint)
        del m.entrypoint[:], m.args[:]
        m.entrypoint.extend(argv[:n])
        m.args.extend(argv[n:])
    shown_env = redact_env(m.env)
    m.env.clear()
    m.env.update(shown_env)
    for r in m.roles:
        argv = redact_argv([*r.entrypoint, *r.args])
        n = len(r.entrypoint)
        del r.entrypoint[:], r.args[:]
        r.entrypoint.extend(argv[:n])
        r.args.extend(argv[n:])
        shown = redact_env(r.env)
        r.env.clear()
        r.env.update(shown)
    m.function_args = b""
    return m


def shown_spec(spec: JobSpec) -> JobSpec:
    """The spec as clients are shown it (what GetJob sends), as a domain object: for every
    other view of a job (the dashboard), so none shows more than GetJob does."""
    m = _shown_spec_pb(spec)
    m.ClearField("result_key")
    return spec_from_pb(m)


def job_status_from_pb(m: pb.Job) -> JobStatus:
    return JobStatus(
        job_id=m.job_id,
        name=m.name,
        state=_JOB_STATES_BACK.get(m.state, JobState.QUEUED),
        reason=m.reason,
        attempt=m.attempt,
        round=m.round,
        max_restarts=m.max_restarts,
        min_nodes=m.min_nodes,
        max_nodes=m.max_nodes,
        members=tuple(
            Member(
                node=x.node,
                addr=x.addr,
                group_rank=x.group_rank,
                nproc=x.nproc,
                done=x.done,
                role=x.role,
                group_state=group_state_from_pb(x.group_state),
            )
            for x in m.members
        ),
        workers=tuple(
            WorkerStatus(
                global_rank=w.global_rank,
                local_rank=w.local_rank,
                node=w.node,
                state=_WORKER_STATES_BACK.get(w.state, WorkerState.UNKNOWN),
                pid=w.pid,
                cpu_percent=w.cpu_percent,
                rss_bytes=w.rss_bytes,
                proc_state=w.proc_state,
                exitcode=w.exitcode if _WORKER_STATES_BACK.get(w.state) in _EXITED else None,
                role=w.role,
                role_rank=w.role_rank,
                world_size=w.world_size,
                role_world_size=w.role_world_size,
                gpu=_worker_gpu_from_pb(w),
                **_progress_from_pb(w),
            )
            for w in m.workers
        ),
        stall_reason=m.stall_reason,
        stalled_since=m.stalled_since,
        nodes_joined=m.nodes_joined,
        last_call_deadline=m.last_call_deadline,
        world_size=m.world_size,
        submitted_at=m.submitted_at,
        finished_at=m.finished_at,
    )


def _progress_to_pb(w: WorkerStatus) -> dict[str, Any]:
    if w.step is None:
        return {"behind": w.behind, "straggler": w.straggler}
    return {
        "has_progress": True,
        "step": w.step,
        "steps_per_s": w.steps_per_s,
        "last_step_age_s": w.last_step_age or 0.0,
        "metrics": dict(w.metrics),
        "behind": w.behind,
        "straggler": w.straggler,
    }


def _progress_from_pb(w: pb.WorkerStatus) -> dict[str, Any]:
    if not w.has_progress:
        return {"behind": w.behind, "straggler": w.straggler}
    return {
        "step": w.step,
        "steps_per_s": w.steps_per_s,
        "last_step_age": w.last_step_age_s,
        "metrics": dict(w.metrics),
        "behind": w.behind,
        "straggler": w.straggler,
    }


def _worker_gpu_from_pb(w: pb.WorkerStatus) -> WorkerGpu | None:
    if w.gpu_index < 0 or not w.gpu_uuid:
        return None
    return WorkerGpu(
        index=w.gpu_index,
        uuid=w.gpu_uuid,
        utilization_percent=w.gpu_utilization_percent,
        memory_used=w.gpu_memory_used_bytes,
        memory_total=w.gpu_memory_total_bytes,
        temperature_c=w.gpu_temperature_c,
    )


def node_to_pb(n: NodeInfo) -> pb.Node:
    return pb.Node(
        name=n.name,
        addr=n.addr,
        slots=n.slots,
        slots_used=n.slots_used,
        state=n.state,
        last_seen=n.last_seen,
        jobs=list(n.jobs),
        # No incarnation: it is what an agent's session is known by, never shown to clients.
        quarantine_reason=n.quarantine_reason,
        quarantined_until=n.quarantined_until,
        drain_reason=n.drain_reason,
        drain_deadline=n.drain_deadline,
        drained_since=n.drained_since,
        drain_by_agent=n.drain_by_agent,
        gpus=[gpu_device_to_pb(g) for g in n.gpus],
        gpu_health=[gpu_health_to_pb(h) for h in n.gpu_health],
        gpus_used=list(n.gpus_used),
        clock_offset=n.clock_offset,
        clock_uncertainty=n.clock_uncertainty,
    )


def gpu_device_to_pb(g: GpuDevice) -> pb.GpuDevice:
    return pb.GpuDevice(index=g.index, uuid=g.uuid, name=g.name, memory_total=g.memory_total)


def gpu_health_to_pb(h: GpuHealth) -> pb.GpuHealth:
    return pb.GpuHealth(
        index=h.index,
        utilization_percent=h.utilization_percent,
        memory_used=h.memory_used,
        temperature_c=h.temperature_c,
        uncorrectable_ecc=h.uncorrectable_ecc,
        lost=h.lost,
    )


def gpu_device_from_pb(m: pb.GpuDevice) -> GpuDevice:
    return GpuDevice(m.index, m.uuid, m.name, m.memory_total)


def gpu_health_from_pb(m: pb.GpuHealth) -> GpuHealth:
    """A health sample, its percentages and counts brought into range (a node sends them)."""
    return GpuHealth(
        index=m.index,
        utilization_percent=min(100.0, max(0.0, m.utilization_percent)),
        memory_used=max(0, m.memory_used),
        temperature_c=m.temperature_c,
        uncorrectable_ecc=max(0, m.uncorrectable_ecc),
        lost=m.lost,
    )


def node_from_pb(m: pb.Node) -> NodeInfo:
    return NodeInfo(
        name=m.name,
        addr=m.addr,
        slots=m.slots,
        slots_used=m.slots_used,
        state=m.state,
        last_seen=m.last_seen,
        jobs=tuple(m.jobs),
        incarnation=m.incarnation,
        gpus=tuple(gpu_device_from_pb(g) for g in m.gpus),
        gpu_health=tuple(gpu_health_from_pb(h) for h in m.gpu_health),
        gpus_used=tuple(m.gpus_used),
        quarantine_reason=m.quarantine_reason,
        quarantined_until=m.quarantined_until,
        clock_offset=m.clock_offset,
        clock_uncertainty=m.clock_uncertainty,
        drain_reason=m.drain_reason,
        drain_deadline=m.drain_deadline,
        drained_since=m.drained_since,
        drain_by_agent=m.drain_by_agent,
    )


def event_to_pb(e: JobEvent) -> pb.Event:
    return pb.Event(
        seq=e.seq,
        job_id=e.job_id,
        timestamp=e.timestamp,
        kind=e.kind,
        reason=e.reason,
        attempt=e.attempt,
        round=e.round,
        node=e.node,
        rank=e.rank,
    )


def event_from_pb(m: pb.Event) -> JobEvent:
    return JobEvent(
        seq=m.seq,
        job_id=m.job_id,
        timestamp=m.timestamp,
        kind=m.kind,
        reason=m.reason,
        attempt=m.attempt,
        round=m.round,
        node=m.node,
        rank=m.rank,
    )
