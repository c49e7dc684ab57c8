"""The console's email settings, checked: EMAIL_BACKEND=django.core.mail.backends.filebased.EmailBackend writes each
email into the directory EMAIL_FILE_PATH, which must be one the process can write to (or create). Chosen without
one, Django's backend fails every send, long after the start; console/settings.py refuses to start instead, and
console.checks (`manage.py check`, and every management command's start) says the same of MAILERS as it stands.
Nothing here touches the file system: it only looks. (Plain Python: console/settings.py imports it.)"""

from __future__ import annotations

import os
from pathlib import Path

FILE_BACKEND = "django.core.mail.backends.filebased.EmailBackend"


def file_path_problem(path: str | None) -> str | None:
    """Why the file backend could not write its emails into `path`, or None when it can: the directory exists and
    is writable, or its nearest existing ancestor is a writable directory (the backend creates the rest)."""
    if not path:
        return "EMAIL_FILE_PATH is not set"
    target = Path(path).absolute()
    if target.exists() and not target.is_dir():
        return f"EMAIL_FILE_PATH {str(target)!r} exists and is not a directory"
    existing = target
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir():
        return f"EMAIL_FILE_PATH {str(target)!r} cannot be created: {str(existing)!r} is not a directory"
    if not os.access(existing, os.W_OK | os.X_OK):
        return f"EMAIL_FILE_PATH {str(target)!r} is not writable by this process"
    return None
