"""Which kubectl dgpipe runs: the one place that looks it up (manifests, deploy and doctor all ask here)."""

from __future__ import annotations

import os
import shutil

from pipeline.errors import DgpipeError

KUBECTL_ENV = "DGPIPE_KUBECTL"  # a kubectl to use instead of the one on PATH (tests point it at a stand-in)
INSTALL_HINT = "install kubectl >= 1.27 (its built-in kustomize renders the overlays)"


def kubectl_name() -> str:
    """kubectl as a command line names it: $DGPIPE_KUBECTL, else plain `kubectl` (not resolved, so a plan
    can be printed where kubectl is not installed)."""
    return os.environ.get(KUBECTL_ENV) or "kubectl"


def find_kubectl() -> str | None:
    """The kubectl to run: $DGPIPE_KUBECTL, else the one on PATH; None when there is none."""
    return os.environ.get(KUBECTL_ENV) or shutil.which("kubectl")


def kubectl_binary() -> str:
    """`find_kubectl`, or a clear error naming how to install it."""
    exe = find_kubectl()
    if not exe:
        raise DgpipeError("kubectl not found", INSTALL_HINT)
    return exe
