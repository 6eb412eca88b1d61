"""`trainpod job ssh --submit`'s key and known_hosts files, read with asyncssh's own importers before any
host is tried: a missing file, a key behind a passphrase with no agent to hold it, or a file that is
not what it should be is the flag's 64 (the variable's 78) in one line, never "unreachable" (69, which
a caller would retry) nor a traceback from inside the connection.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import Any

with warnings.catch_warnings():
    # asyncssh names cryptography's DSA types at import, which cryptography deprecates (a UserWarning of its own, once
    # per name): ten lines on stderr before the launcher's own, though no DSA key is read unless the user passes one.
    warnings.filterwarnings("ignore", category=UserWarning, module=r"asyncssh\.")
    import asyncssh

from trainpod.errors import error_for
from trainpod.jobs.values import printable, read_bytes, read_text
from trainpod.settings import Values

__all__ = ["client_options"]


def client_options(options: Values, env: Mapping[str, str]) -> dict[str, Any]:
    """asyncssh.connect's keyword arguments for --identity and --known-hosts (none where they are not given:
    asyncssh's defaults, ssh-agent and ~/.ssh, then apply)."""
    result: dict[str, Any] = {}
    if options.identity:
        result.update(_identity(options.identity, options.origins["identity"], env))
    if options.known_hosts:
        result["known_hosts"] = _known_hosts(options.known_hosts, options.origins["known_hosts"])
    return result


def _identity(path: str, origin: str, env: Mapping[str, str]) -> dict[str, Any]:
    error = error_for(origin)
    data = read_bytes(path, origin, "an SSH private key file")
    try:
        asyncssh.import_private_key(data)
    except ValueError as exc:  # KeyImportError, KeyEncryptionError, UnicodeDecodeError
        if not str(exc).startswith("Passphrase"):  # asyncssh's own test for an encrypted key (load_keypairs)
            raise error(f"{origin}={path!r}: not a private key asyncssh can read ({printable(str(exc))}): expected an "
                        "SSH private key in OpenSSH, PEM or PKCS#8 format (the key, not its .pub)") from None
        agent = env.get("SSH_AUTH_SOCK", "").strip()
        if not agent:
            raise error(f"{origin}={path!r}: the key is protected by a passphrase and no ssh-agent runs (SSH_AUTH_SOCK "
                        "is not set): expected a key without a passphrase, or the key added to an agent (ssh-add)") from None
        # The agent holds the key unlocked (OpenSSH's way): asyncssh skips the locked file and signs with the
        # agent, the one this check saw.
        return {"client_keys": [path], "ignore_encrypted": True, "agent_path": agent}
    return {"client_keys": [path]}


def _known_hosts(path: str, origin: str) -> asyncssh.SSHKnownHosts:
    # Read here rather than by asyncssh: a BOM is taken off, another encoding is one line.
    text = read_text(path, origin, "a known_hosts file")
    try:
        return asyncssh.import_known_hosts(text)
    except ValueError as exc:
        raise error_for(origin)(f"{origin}={path!r}: {printable(str(exc))}: expected OpenSSH's known_hosts format "
                                "(host-patterns key-type base64-key a line)") from None
