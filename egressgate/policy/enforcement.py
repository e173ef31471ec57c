"""Who enforces each policy key (issue 22, "no silent keys"): pure data, and the pure functions that read it.

Every key path of the policy schema (policy/model.py, mcp_model.py, persistence.py, the credential
capabilities of broker/config.py) has one entry here, and tests/policy/test_no_silent_keys.py walks the
schema to prove it: no path without an entry, no entry without a path, and every entry names the tests that
fail when its enforcement is removed. Who:

* `gateway` / `resolver`: decided on every request or query (policy/decide.py, gateway/, dns/);
* `runtime`: enforced by the runtime that runs the sandbox (`sandbox run`, egressgate/runtimes/); which
  runtimes do is declared in runtimes/registry.py (`ENFORCES`). A container routed by hand through the
  gateway does not get these. `sandbox run` refuses a runtime that does not enforce one the policy sets;
* `loader`: only shapes or names the policy (`sandbox.name`, rule ids) or the loader accepts nothing but
  its default (compiler.py refuses the rest), so there is nothing to enforce at run time;
* `refused`: nothing enforces it in this version: `egressgate policy check` refuses a policy that writes it
  and `sandbox run` refuses to start one. Such an entry becomes enforced by changing `by` (and naming the
  tests) in the same commit that makes something enforce it.

Paths: `a.b` a field, `[]` any list item, `{}` any mapping value; union members (credential capabilities)
share the parent's path. An entry `key=value` covers one value of an enumerated key (for keys whose values
are enforced by different components, e.g. the approval kinds). Entries are written with `{x,y}`
alternatives so rule lists whose semantics are shared share one entry.

Stdlib only: `sandbox run` imports this at start-up (loadtests/RESULTS.md).
"""

from __future__ import annotations

import itertools
import posixpath
import re
from typing import Any, NamedTuple

GATEWAY, RESOLVER, RUNTIME, LOADER, REFUSED = "gateway", "resolver", "runtime", "loader", "refused"
OWN_TMP = "/tmp"  # noqa: S108 - the sandbox's private /tmp (policy/filesystem.py), not a host path


class Key(NamedTuple):
    name: str  # the entry's name (policy check and sandbox run name it); its first path, unexpanded
    by: str  # gateway | resolver | runtime | loader | refused
    where: str  # the module that enforces (or refuses) it
    tests: tuple[str, ...]  # `tests/path.py::test_name`: fail when the enforcement is removed (negative+positive)


def expand(pattern: str) -> list[str]:
    """`network.{https,http}.allow[].host` → both paths (the cartesian product of every `{a,b}`)."""
    parts = re.split(r"(\{[^{}]*,[^{}]*\})", pattern)
    choices = [p[1:-1].split(",") if p.startswith("{") and "," in p else [p] for p in parts]
    return ["".join(c) for c in itertools.product(*choices)]


_R = "network.{https,http,tcp}.{allow,deny}[]"  # every rule list
_L7 = "network.{https,http}.{allow,deny}[]"  # rule lists that read HTTP
_CAP = "credentials.capabilities{}"
_TOOL = "mcp.servers[].tools.allow[]"
_ARG = _TOOL + ".arguments{}"

_DECIDE = "tests/policy/test_decide.py::"
_RESOLVE = "tests/dns_resolver/test_resolve.py::"
_MCP = "tests/policy/test_mcp_decide.py::"
_ARGS = "tests/policy/test_mcp_arguments.py::"
_PERSIST = "tests/runtimes/test_persistence.py::"
_LIFE = "tests/runtimes/test_run_lifecycle.py::"
_DOCKER = "tests/runtimes/test_docker_adapter.py::"

KEYS: tuple[Key, ...] = (
    # --- the policy itself -----------------------------------------------------------------------
    Key(
        "sandbox.name",
        LOADER,
        "policy/loader.py",
        ("tests/policy/test_model.py::test_directory_loads_many_policies_keyed_by_name",),
    ),
    Key(
        "description",
        LOADER,
        "policy/model.py",
        ("tests/policy/test_model.py::test_hash_is_stable_across_formatting_and_changes_with_meaning",),
    ),
    # --- sandbox: the runtime --------------------------------------------------------------------
    Key(
        "sandbox.root_fs",
        RUNTIME,
        "runtimes/netns.py, runtimes/docker.py",
        ("tests/runtimes/test_netns_escape.py::test_admission_checks_inside", _DOCKER + "test_isolation"),
    ),
    Key(
        "sandbox.workspace.path",
        RUNTIME,
        "runtimes/run.py",
        (_LIFE + "test_every_run_is_a_new_admission_only_the_workspace_survives",),
    ),
    Key(
        "sandbox.workspace.persistent",
        RUNTIME,
        "runtimes/run.py",
        ("tests/runtimes/test_workspace_persistent.py::test_a_kept_workspace_needs_persistent_true",),
    ),
    Key(
        "sandbox.workspace.max_bytes",
        RUNTIME,
        "runtimes/diskfs.py",
        (
            "tests/runtimes/test_run_disk_limits.py::test_fallocate_in_a_temporary_workspace_gets_enospc",
            "tests/runtimes/test_docker_disk_limits.py::test_temporary_workspace_full_gets_enospc_and_123",
            "tests/runtimes/test_docker_disk_limits.py::test_persistent_workspace_image",
        ),
    ),
    Key(
        "sandbox.tmp.max_bytes",
        RUNTIME,
        "runtimes/diskfs.py, runtimes/docker.py",
        (
            "tests/runtimes/test_run_disk_limits.py::test_tmp_is_bounded",
            "tests/runtimes/test_docker_disk_limits.py::test_tmp_is_bounded_and_under_the_limit_fits",
        ),
    ),
    Key(
        "sandbox.resources.cpu_millis",
        RUNTIME,
        "runtimes/limits.py, runtimes/docker.py",
        ("tests/runtimes/test_limits_cgroups.py::test_cpu_quota_throttles_a_busy_loop",),
    ),
    Key(
        "sandbox.resources.memory_mb",
        RUNTIME,
        "runtimes/limits.py, runtimes/docker.py",
        (
            "tests/runtimes/test_run_limits.py::test_memory_growth_hits_the_memory_limit",
            _DOCKER + "test_memory_limit_reports_memory",
        ),
    ),
    Key(
        "sandbox.resources.pids_max",
        RUNTIME,
        "runtimes/limits.py, runtimes/docker.py",
        (
            "tests/runtimes/test_run_limits.py::test_fork_storm_hits_the_pids_limit",
            _DOCKER + "test_pids_limit_reports_pids",
            _DOCKER + "test_gvisor_pids_max_caps_the_workload",
        ),
    ),
    Key(
        "sandbox.resources.wall_time_seconds",
        RUNTIME,
        "runtimes/run.py",
        ("tests/runtimes/test_run_limits.py::test_sleep_past_wall_time_is_killed", _DOCKER + "test_wall_time_kills"),
    ),
    Key(
        "sandbox.resources.outbound_bytes_max",
        GATEWAY,
        "policy/decide.py, gateway/",
        (_DECIDE + "test_rule_budgets_and_sandbox_byte_budget",),
    ),
    # --- filesystem: the runtime -----------------------------------------------------------------
    Key(
        "filesystem.allow[].path",
        RUNTIME,
        "runtimes/sandbox_fs.py, runtimes/docker.py",
        (
            "tests/runtimes/test_netns_fs.py::test_only_the_allowlist_exists_inside",
            "tests/runtimes/test_docker_escape.py::test_filesystem_allow_and_setid",
        ),
    ),
    Key(
        "filesystem.allow[].read",
        RUNTIME,
        "runtimes/sandbox_fs.py, policy/filesystem.py",
        (
            "tests/policy/test_filesystem_keys.py::test_unhonourable_allow_entries_are_refused",
            "tests/runtimes/test_netns_fs.py::test_only_the_allowlist_exists_inside",
        ),
    ),
    Key(
        "filesystem.allow[].write",
        RUNTIME,
        "runtimes/sandbox_fs.py, runtimes/docker.py",
        (
            "tests/runtimes/test_netns_fs.py::test_only_the_allowlist_exists_inside",
            "tests/runtimes/test_docker_escape.py::test_filesystem_allow_and_setid",
        ),
    ),
    Key(
        "filesystem.deny",
        RUNTIME,
        "runtimes/netns.py, runtimes/dockermasks.py",
        ("tests/runtimes/test_netns_fs.py::test_only_the_allowlist_exists_inside", _DOCKER + "test_isolation"),
    ),
    # --- network: the gateway and the resolver ---------------------------------------------------
    Key(
        "network.default",
        GATEWAY,
        "policy/decide.py",
        ("tests/gateway/test_enforcement.py::test_unlisted_host_and_wrong_port_denied_at_connect",),
    ),
    Key(
        "network.metadata_endpoints",
        GATEWAY,
        "policy/addr.py",
        (_DECIDE + "test_allow_private_covers_internal_but_never_metadata",),
    ),
    Key(
        "network.allow_private",
        GATEWAY,
        "policy/addr.py",
        (
            _DECIDE + "test_allow_private_covers_internal_but_never_metadata",
            _RESOLVE + "test_allow_private_covers_rfc1918_but_never_metadata",
        ),
    ),
    Key(
        "network.dns.allow",
        RESOLVER,
        "dns/",
        (
            _DECIDE + "test_dns_allowlist_is_dns_allow_plus_rule_hosts",
            _RESOLVE + "test_denied_names_never_reach_upstream",
        ),
    ),
    Key(
        "network.dns.deny_answer",
        RESOLVER,
        "dns/",
        (
            "tests/dns_resolver/test_gateway_answer.py::test_a_denied_name_resolves_to_the_gateway_without_an_upstream_query",
            "tests/dns_resolver/test_gateway_answer.py::test_deny_answer_rcode_keeps_nxdomain",
        ),
    ),
    Key("network.dns.deny_rcode", RESOLVER, "dns/", (_RESOLVE + "test_policy_deny_rcode_refused",)),
    Key(
        "network.dns.query_types",
        RESOLVER,
        "dns/",
        (_RESOLVE + "test_query_types_txt_any_axfr_refused", _RESOLVE + "test_policy_can_allow_txt_but_never_axfr"),
    ),
    Key(
        "network.dns.budget.{queries,name_bytes,per_second}",
        RESOLVER,
        "policy/decide.py, dns/",
        (_DECIDE + "test_dns_budgets",),
    ),
    Key(_R + ".host", GATEWAY, "policy/decide.py", (_DECIDE + "test_wildcard_matches_subdomains_not_apex",)),
    Key(
        _R + ".except_hosts",
        GATEWAY,
        "policy/decide.py",
        (_DECIDE + "test_history_condition_after_request_to_secrets_denies_post_elsewhere",),
    ),
    Key(
        _R + ".ports",
        GATEWAY,
        "policy/decide.py",
        (
            "tests/escape/test_transparent.py::test_host_with_another_port_is_refused",
            "tests/escape/test_transparent.py::test_host_with_the_dialed_port_is_allowed",
        ),
    ),
    Key(
        _R + ".id",
        LOADER,
        "policy/compiler.py",
        ("tests/policy/test_model.py::test_duplicate_rule_ids_and_yaml_keys_are_errors",),
    ),
    Key(
        _L7 + ".methods",
        GATEWAY,
        "policy/decide.py",
        ("tests/gateway/test_enforcement.py::test_wrong_method_or_path_denied_upstream_untouched",),
    ),
    Key(
        _L7 + ".paths",
        GATEWAY,
        "policy/decide.py",
        ("tests/gateway/test_enforcement.py::test_wrong_method_or_path_denied_upstream_untouched",),
    ),
    Key(
        _L7 + ".query",
        GATEWAY,
        "policy/querymatch.py, policy/decide.py",
        (
            "tests/policy/test_query_rules.py::test_a_push_spelling_is_refused_by_the_clone_only_rule",
            "tests/policy/test_query_rules.py::test_positive_control_the_clone_request_is_allowed",
        ),
    ),
    Key(
        _L7 + ".credential",
        GATEWAY,
        "broker/, gateway/",
        (
            _DECIDE + "test_credential_and_paths",
            "tests/policy/test_model.py::test_credentials_only_on_https_allow_rules",
        ),
    ),
    Key(
        _L7 + ".tls",
        GATEWAY,
        "policy/passthrough.py, gateway/",
        (
            "tests/policy/test_passthrough.py::test_tls_only_on_https_allow_rules",
            "tests/policy/test_passthrough.py::test_connect_decision_carries_the_tunnel_mode",
        ),
    ),
    Key(
        _R + ".when.{labels,within_seconds,after_seconds,sandbox}",
        GATEWAY,
        "policy/decide.py",
        (_DECIDE + "test_label_and_time_conditions",),
    ),
    Key(
        _R + ".when.{after_request_to,unless_request_to}",
        GATEWAY,
        "policy/decide.py",
        (_DECIDE + "test_history_condition_after_request_to_secrets_denies_post_elsewhere",),
    ),
    Key(
        _R + ".budget.{requests,bytes}",
        GATEWAY,
        "policy/decide.py, gateway/",
        (
            _DECIDE + "test_rule_budgets_and_sandbox_byte_budget",
            "tests/policy/test_passthrough.py::test_relayed_tunnels_budget_requests_not_bytes",
        ),
    ),
    # --- credentials: the gateway's broker ----------------------------------------------------------
    Key(
        "credentials.{inject_via,agent_visibility}",
        GATEWAY,
        "broker/, gateway/",
        ("tests/broker/test_inject.py::test_phantom_misuse_everywhere_else",),
    ),
    Key(
        "credentials.max_ttl_seconds",
        GATEWAY,
        "broker/",
        ("tests/broker/test_vault.py::test_jwt_ttl_clamped_and_configured_audience",),
    ),
    Key(
        _CAP + ".{type,source.file,source.vault.path,source.vault.field,source.vault.mount,ttl_seconds}",
        GATEWAY,
        "broker/",
        (
            "tests/broker/test_vault.py::test_kv_static_secret",
            "tests/broker/test_vault.py::test_missing_field_is_unavailable",
        ),
    ),
    Key(
        _CAP + ".{placement.header,placement.format,placement.basic.username,placement.query}",
        GATEWAY,
        "broker/inject.py",
        (
            "tests/gateway_credentials/test_inject.py::test_basic_and_query_placements",
            "tests/broker/test_inject.py::test_basic_auth",
        ),
    ),
    Key(
        _CAP + ".{mode,phantom_env}",
        GATEWAY,
        "broker/inject.py",
        ("tests/broker/test_inject.py::test_phantom_swapped_only_in_configured_header",),
    ),
    Key(
        _CAP + ".audience",
        GATEWAY,
        "broker/",
        ("tests/broker/test_vault.py::test_jwt_ttl_clamped_and_configured_audience",),
    ),
    Key(_CAP + ".role", GATEWAY, "broker/", ("tests/broker/test_vault.py::test_oidc_role_token",)),
    # --- execution ---------------------------------------------------------------------------------
    Key(
        "execution.commands",
        RUNTIME,
        "runtimes/workload.py (check_command)",
        (
            _LIFE + "test_command_allow_list",
            "tests/runtimes/test_command_allowed.py::test_check_command_uses_the_basename_and_names_the_refusal",
        ),
    ),
    Key(
        "execution.local_mcp_servers",
        GATEWAY,
        "policy/mcp_decide.py (decide_local_start)",
        (
            _MCP + "test_decide_local_start",
            "tests/mcp/test_local_relay.py::test_refused_local_start_never_runs_the_server",
        ),
    ),
    Key(
        "execution.package_install=allow",
        GATEWAY,
        "policy/opclass.py, policy/decide.py",
        (
            "tests/policy/test_decide_opclass.py::test_package_install_deny_refuses_what_the_rule_allows_and_allow_leaves_it_to_the_rules",
            "tests/approvals/test_opclass_clients.py::test_pip_download_and_install_are_refused_under_deny_and_work_under_allow",
        ),
    ),
    Key(
        "execution.package_install=deny",
        GATEWAY,
        "policy/opclass.py, policy/decide.py",
        (
            "tests/policy/test_decide_opclass.py::test_package_install_deny_refuses_what_the_rule_allows_and_allow_leaves_it_to_the_rules",
            "tests/approvals/test_opclass_clients.py::test_npm_install_is_refused_under_deny_and_works_under_allow",
        ),
    ),
    Key(
        "execution.package_install=approval",
        GATEWAY,
        "policy/opclass.py, policy/decide.py, approvals/",
        (
            "tests/policy/test_decide_opclass.py::test_package_install_approval_waits_and_a_grant_of_that_kind_lets_it_through",
            "tests/approvals/test_opclass_clients.py::test_pip_install_waits_for_an_operator_under_approval",
        ),
    ),
    Key(
        "execution.require_approval_for=network_expansion",
        GATEWAY,
        "approvals/",
        (
            "tests/approvals/test_overlay.py::test_outside_the_allowlist_is_approval_required_with_the_allowlist_reason_as_detail",
        ),
    ),
    Key(
        "execution.require_approval_for=persistent_write",
        RUNTIME,
        "runtimes/persist.py",
        (
            _PERSIST + "test_an_approved_write_is_applied_with_every_path_listed",
            _PERSIST + "test_a_denied_write_is_discarded_and_a_pending_one_blocks_the_next_run",
        ),
    ),
    Key(
        "execution.require_approval_for=publish",
        GATEWAY,
        "policy/opclass.py, policy/decide.py, approvals/",
        (
            "tests/policy/test_decide_opclass.py::test_publish_waits_for_approval_even_when_a_rule_allows_method_and_path",
            "tests/approvals/test_opclass_clients.py::test_git_push_without_publish_approval_is_left_to_the_network_rules",
            "tests/approvals/test_opclass_clients.py::test_npm_publish_waits_for_approval_and_passes_after_it",
        ),
    ),
    # --- persistence: the runtime ------------------------------------------------------------------
    Key(
        "persistence.{save,discard}",
        RUNTIME,
        "runtimes/persist.py",
        (_PERSIST + "test_only_save_paths_survive_and_the_manifest_is_audited",),
    ),
    Key(
        "persistence.restore_checks",
        RUNTIME,
        "runtimes/persist.py, runtimes/restore_checks.py",
        (
            _PERSIST + "test_a_workspace_changed_between_runs_is_refused_then_accepted",
            _PERSIST + "test_a_restore_after_a_policy_change_names_both_hashes",
            _PERSIST + "test_a_restore_reissues_the_phantom_credential_and_the_old_one_is_worthless",
        ),
    ),
    # --- mcp: the gateway's MCP mediator -----------------------------------------------------------
    Key(
        "mcp.record_arguments",
        GATEWAY,
        "mcp/",
        ("tests/mcp/test_mediator.py::test_recorded_arguments_are_opt_in_and_redacted",),
    ),
    Key("mcp.max_message_bytes", GATEWAY, "mcp/", ("tests/policy/test_mcp_load.py::test_max_message_bytes_bounds",)),
    Key(
        "mcp.servers[].{name,url,local,transport}",
        GATEWAY,
        "policy/mcp_decide.py, mcp/",
        (_MCP + "test_unknown_server_denied", _MCP + "test_mcp_server_for_routes", _MCP + "test_local_server"),
    ),
    Key(
        "mcp.servers[].{server_info.name,server_info.version}",
        GATEWAY,
        "policy/mcp_decide.py",
        (_MCP + "test_server_info_pin",),
    ),
    Key("mcp.servers[].tool_schemas", GATEWAY, "policy/mcp_decide.py", (_MCP + "test_tool_schema_pin",)),
    Key("mcp.servers[].trust_on_first_use", GATEWAY, "policy/mcp_decide.py", (_MCP + "test_trust_on_first_use",)),
    Key(
        "mcp.servers[].{budget.calls,tools.allow[].budget.calls}",
        GATEWAY,
        "policy/mcp_decide.py",
        (_MCP + "test_budgets_server_then_tool",),
    ),
    Key(
        "mcp.servers[].{tools.allow[].name,tools.deny}",
        GATEWAY,
        "policy/mcp_decide.py",
        (_MCP + "test_deny_wins_over_allow", _MCP + "test_default_deny_unlisted_tool"),
    ),
    Key(_TOOL + ".id", LOADER, "policy/mcp_compile.py", (_MCP + "test_default_rule_id_and_no_budget_keys",)),
    Key(_TOOL + ".approval", GATEWAY, "policy/mcp_decide.py", (_MCP + "test_approval_required_then_granted",)),
    Key(
        _TOOL + ".unlisted_arguments",
        GATEWAY,
        "policy/mcp_args.py",
        (_ARGS + "test_unlisted_arguments_denied_by_default",),
    ),
    Key(_ARG + ".{type,enum}", GATEWAY, "policy/mcp_args.py", (_ARGS + "test_enum_strict_types",)),
    Key(_ARG + ".pattern", GATEWAY, "policy/mcp_args.py", (_ARGS + "test_pattern_fullmatch_and_anchors",)),
    Key(
        _ARG + ".{min,max}",
        GATEWAY,
        "policy/mcp_args.py",
        (
            _ARGS + "test_integer_refusals",
            _ARGS + "test_integer_positive_controls",
        ),
    ),
    Key(
        _ARG + ".max_length",
        GATEWAY,
        "policy/mcp_args.py",
        (_ARGS + "test_max_length_counts_code_points_and_needs_a_string",),
    ),
    Key(
        _ARG + ".path_prefix",
        GATEWAY,
        "policy/mcp_args.py",
        (_ARGS + "test_path_prefix_positive_controls", _ARGS + "test_path_prefix_bypasses_refused"),
    ),
    Key(
        _ARG + ".allowed_by_network",
        GATEWAY,
        "policy/mcp_args.py",
        (_ARGS + "test_allowed_by_network_positive_controls", _ARGS + "test_allowed_by_network_refusals"),
    ),
    Key(_ARG + ".equals_label", GATEWAY, "policy/mcp_args.py", (_ARGS + "test_equals_label",)),
    Key(
        _ARG + ".required",
        GATEWAY,
        "policy/mcp_args.py",
        (_ARGS + "test_required_argument_missing_is_refused_and_present_passes",),
    ),
)

_INDEX: dict[str, Key] = {}


def index() -> dict[str, Key]:
    """Every concrete path (or `path=value`) → its entry; built on first use (`sandbox run` never needs it:
    its start-up is measured)."""
    if not _INDEX:
        _INDEX.update({path: key for key in KEYS for path in expand(key.name)})
    return _INDEX


# the keys whose values are enforced by different components: their entries are per value
# entry name → entry (what set_keys returns, policy check prints and sandbox run refuses)
NAMED: dict[str, Key] = {key.name: key for key in KEYS}
BY_VALUE = ("execution.package_install", "execution.require_approval_for")
RUNTIME_KEYS: frozenset[str] = frozenset(k.name for k in KEYS if k.by == RUNTIME)


def _norm(path: str) -> str:
    return re.sub(r"\{[^}]*\}", "{}", re.sub(r"\[\d+\]", "[]", path))


# runtime keys whose DEFAULT is a constraint (a read-only root, a bounded /tmp; with a workspace, a fresh one per
# run): a runtime that does not enforce them would leave an unwritten default silent, so they are always "set"
CONSTRAINING_DEFAULTS = ("sandbox.root_fs", "sandbox.tmp.max_bytes")


def set_keys(model: Any) -> list[str]:
    """The entries a loaded policy (a policy/model.py `Policy`) sets: every field the file writes (pydantic's
    `model_fields_set`, recursively; for BY_VALUE keys the value written), plus the runtime keys whose
    default constrains (CONSTRAINING_DEFAULTS, and sandbox.workspace.persistent when there is a workspace).
    A written default counts as set: `package_install: deny` written is a promise. Sorted, unique."""
    out: set[str] = set()
    paths = index()
    sandbox = getattr(model, "sandbox", None)
    workspace = getattr(sandbox, "workspace", None)
    # a filesystem.allow entry naming the sandbox's own workspace or /tmp binds no host path: it states what
    # every runtime gives anyway (policy/filesystem.py), so it sets nothing a runtime could fail to enforce
    own = {posixpath.normpath(p) for p in (workspace.path if workspace else None, OWN_TMP) if p}

    def visit(obj: Any, prefix: str) -> None:
        if isinstance(obj, list):
            for item in obj:
                if prefix == "filesystem.allow" and posixpath.normpath(getattr(item, "path", "") or ".") in own:
                    continue
                visit(item, prefix + "[]")
            return
        if isinstance(obj, dict):
            for item in obj.values():
                visit(item, prefix + "{}")
            return
        fields = getattr(obj, "model_fields_set", None)
        if fields is None:
            return
        for name in fields:
            path = f"{prefix}.{name}" if prefix else name
            value = getattr(obj, name)
            if path in BY_VALUE:
                for v in value if isinstance(value, list) else [value]:
                    entry = paths.get(f"{path}={v}")
                    if entry is not None:
                        out.add(entry.name)
                continue
            entry = paths.get(path)
            if entry is not None:
                out.add(entry.name)
            visit(value, path)

    visit(model, "")
    if sandbox is not None:  # defaults that constrain apply whether written or not
        out.update(CONSTRAINING_DEFAULTS)
        if sandbox.workspace is not None:
            out.add("sandbox.workspace.persistent")
    return sorted(out)


_CHECKED: dict[str, list[str]] = {}


def admission_keys(model: Any, policy_hash: str) -> list[str]:
    """`set_keys`, handed out in the admission response (`runtime_policy.keys`) so `sandbox run` checks them
    against ITS table and runtime (an entry it does not know is refused: fail closed across versions);
    memoized per policy hash (admission is a hot path)."""
    keys = _CHECKED.get(policy_hash)
    if keys is None:
        if len(_CHECKED) > 256:  # policies reloaded many times: start over rather than grow
            _CHECKED.clear()
        keys = _CHECKED[policy_hash] = set_keys(model)
    return list(keys)


def runtimes_enforcing(name: str, enforces: dict[str, frozenset[str]]) -> list[str]:
    return sorted(r for r, keys in enforces.items() if name in keys)


def unenforced(keys: list[str] | tuple[str, ...], runtime: str, enforces: dict[str, frozenset[str]]) -> list[str]:
    """Of the entries a policy sets (`set_keys`), those `runtime` would leave unenforced: `refused` ones
    (nobody enforces them), `runtime` ones the runtime does not declare (runtimes/registry.py), and names this
    table does not know (a newer gateway's: fail closed)."""
    mine = enforces.get(runtime, frozenset())
    out = []
    for name in keys:
        entry = NAMED.get(name)
        if entry is None or entry.by == REFUSED or (entry.by == RUNTIME and name not in mine):
            out.append(name)
    return out


def refusal(missing: list[str], runtime: str, enforces: dict[str, frozenset[str]]) -> str:
    """One sentence for `sandbox run` (exit 120)."""
    parts = []
    for name in missing:
        entry = NAMED.get(name)
        able = runtimes_enforcing(name, enforces) if entry is not None and entry.by == RUNTIME else []
        parts.append(f"{name} (enforced by {', '.join(able)})" if able else f"{name} (enforced by no runtime)")
    return (
        f"runtime {runtime} cannot enforce {'; '.join(parts)}, which the policy sets; use a runtime that "
        "does, or drop the key"
    )


def markdown_table(enforces: dict[str, frozenset[str]]) -> str:
    """The "Who enforces each key" table of docs/policy.md (tests/policy/test_no_silent_keys.py keeps the
    docs equal to this)."""
    who = {
        GATEWAY: "gateway",
        RESOLVER: "DNS resolver",
        RUNTIME: "`sandbox run`",
        LOADER: "loader only",
        REFUSED: "**nothing: refused**",
    }
    rows = ["| key | enforced by | where | runtimes |", "|---|---|---|---|"]
    for key in KEYS:
        runtimes = ", ".join(runtimes_enforcing(key.name, enforces)) if key.by == RUNTIME else ""
        name = key.name.replace("|", "\\|")
        rows.append(f"| `{name}` | {who[key.by]} | {key.where} | {runtimes or '-'} |")
    return "\n".join(rows) + "\n"
