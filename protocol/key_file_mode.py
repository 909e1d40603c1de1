"""Who may read a key file: its owner only, or start-up stops (one line naming the fix, exit 78).

A key file others can read is a credential every user of the host holds, so it is refused, not warned
about: ``chmod 600 FILE`` (``pdserve keygen`` writes 0600; a Compose file secret is the host file as it is,
made 0400 and owned by the containers' user, docs/deploy.md).

One layout keeps a group bit and passes: a Kubernetes Secret volume with ``fsGroup``. The kubelet writes
it through its atomic writer (each key a link into ``..data``) and adds group read (0400 becomes 0440)
for the pod's own group, so that a non-root pod can read it at all; the volume is seen by that pod
alone. It passes only with that layout, no write bit and no bit for others, and only when the file's
group is one of this process's own groups.
"""

from __future__ import annotations

import os
import stat

KUBELET_DATA_LINK = "..data"  # the kubelet's atomic writer: <volume>/<key> -> ..data/<key>


class KeyFileModeError(ValueError):
    """A key file others can read or change."""


def check_private(path: str, st: os.stat_result) -> None:
    """Raise ``KeyFileModeError`` unless only the owner (or a kubelet Secret's pod group) can read ``path``."""
    mode = stat.S_IMODE(st.st_mode)
    if not mode & 0o077 or (not mode & 0o037 and _is_pod_group_secret(path, st)):
        return
    who = "other users" if mode & 0o007 else "its group"
    raise KeyFileModeError(
        f"cluster key file {path} is open to {who} (mode {mode:04o}); refusing to start: chmod 600 {path}"
    )


def _is_pod_group_secret(path: str, st: os.stat_result) -> bool:
    folder = os.path.dirname(os.path.abspath(path))
    own_groups = {os.getgid(), *os.getgroups()}
    return os.path.islink(os.path.join(folder, KUBELET_DATA_LINK)) and st.st_gid in own_groups
