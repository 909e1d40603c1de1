"""The Pod Security Standards' "restricted" profile (kubernetes.io/docs/concepts/security/
pod-security-standards/, as of v1.30), checked on a pod spec the way the admission controller checks
it: every control of "baseline", then the restricted ones. Returns what fails, one line each."""

from __future__ import annotations

# restricted: the only volume types a pod may use
ALLOWED_VOLUMES = {
    "configMap",
    "csi",
    "downwardAPI",
    "emptyDir",
    "ephemeral",
    "persistentVolumeClaim",
    "projected",
    "secret",
}
SAFE_SYSCTLS = {
    "kernel.shm_rmid_forced",
    "net.ipv4.ip_local_port_range",
    "net.ipv4.ip_unprivileged_port_start",
    "net.ipv4.tcp_syncookies",
    "net.ipv4.ping_group_range",
    "net.ipv4.ip_local_reserved_ports",
    "net.ipv4.tcp_keepalive_time",
    "net.ipv4.tcp_fin_timeout",
    "net.ipv4.tcp_keepalive_intvl",
    "net.ipv4.tcp_keepalive_probes",
}
SELINUX_TYPES = {None, "", "container_t", "container_init_t", "container_kvm_t", "container_engine_t"}


def restricted_violations(pod: dict) -> list[str]:
    """Everything in ``pod`` (a PodSpec) that Pod Security "restricted" admission would refuse."""
    bad: list[str] = []
    pod_sc = pod.get("securityContext", {})
    for field in ("hostNetwork", "hostPID", "hostIPC"):
        if pod.get(field):
            bad.append(f"{field} is true")
    for volume in pod.get("volumes", []):
        kind = next(k for k in volume if k != "name")
        if kind not in ALLOWED_VOLUMES:
            bad.append(f"volume {volume['name']}: type {kind} is not allowed")
    for sysctl in pod_sc.get("sysctls", []):
        if sysctl["name"] not in SAFE_SYSCTLS:
            bad.append(f"sysctl {sysctl['name']} is not allowed")
    bad += _security_context_violations("pod", pod_sc)
    containers = [*pod.get("initContainers", []), *pod["containers"], *pod.get("ephemeralContainers", [])]
    for c in containers:
        sc, where = c.get("securityContext", {}), f"container {c['name']}"
        bad += _security_context_violations(where, sc)
        if sc.get("privileged"):
            bad.append(f"{where}: privileged")
        if sc.get("allowPrivilegeEscalation") is not False:
            bad.append(f"{where}: allowPrivilegeEscalation must be false")
        if sc.get("procMount", "Default") != "Default":
            bad.append(f"{where}: procMount {sc['procMount']}")
        caps = sc.get("capabilities", {})
        if "ALL" not in caps.get("drop", []):
            bad.append(f"{where}: capabilities must drop ALL")
        if set(caps.get("add", [])) - {"NET_BIND_SERVICE"}:
            bad.append(f"{where}: adds capabilities {sorted(set(caps['add']) - {'NET_BIND_SERVICE'})}")
        if any(p.get("hostPort") for p in c.get("ports", [])):
            bad.append(f"{where}: hostPort")
        # runAsNonRoot and seccomp: set on the container, or inherited from the pod
        if sc.get("runAsNonRoot", pod_sc.get("runAsNonRoot")) is not True:
            bad.append(f"{where}: runAsNonRoot must be true (pod or container)")
        profile = sc.get("seccompProfile", pod_sc.get("seccompProfile", {})).get("type")
        if profile not in ("RuntimeDefault", "Localhost"):
            bad.append(f"{where}: seccompProfile must be RuntimeDefault or Localhost, got {profile}")
        if sc.get("runAsUser", pod_sc.get("runAsUser")) is None:
            # not a rule of the profile, but runAsNonRoot with an image whose USER is a name cannot be
            # verified by the kubelet: the pod would never start. A numeric uid makes it checkable.
            bad.append(f"{where}: runAsUser must be a numeric uid for runAsNonRoot to be checkable")
    return bad


def _security_context_violations(where: str, sc: dict) -> list[str]:
    bad = []
    if sc.get("runAsUser") == 0:
        bad.append(f"{where}: runAsUser 0")
    if sc.get("windowsOptions", {}).get("hostProcess"):
        bad.append(f"{where}: hostProcess")
    if sc.get("seccompProfile", {}).get("type") == "Unconfined":
        bad.append(f"{where}: seccompProfile Unconfined")
    if sc.get("appArmorProfile", {}).get("type") not in (None, "RuntimeDefault", "Localhost"):
        bad.append(f"{where}: appArmorProfile {sc['appArmorProfile']['type']}")
    selinux = sc.get("seLinuxOptions", {})
    if selinux.get("type") not in SELINUX_TYPES or selinux.get("user") or selinux.get("role"):
        bad.append(f"{where}: seLinuxOptions {selinux}")
    return bad
