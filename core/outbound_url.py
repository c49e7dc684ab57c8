"""URLs the console calls on someone else's behalf (an external agent's decision callback): checked when they are
given and again when they are called, so that an agent cannot aim the console at itself or at what only it can
reach (its loopback, the cloud's metadata service at 169.254.169.254, the private network it sits in).

`check(url)` parses the URL (http or https, a host, a port that is a number, no credentials in it), resolves its
host, and refuses it (`Refused`, whose `detail` says why in a sentence) when any address the name resolves to is

- unspecified (0.0.0.0/8, ::), link-local (169.254/16, fe80::/10), multicast or reserved (240/4): always;
- loopback (127/8, ::1): unless the host is named in CALLBACK_ALLOWED_HOSTS;
- private (10/8, 172.16/12, 192.168/16, 100.64/10, fc00::/7, the documentation ranges, ...): unless
  CALLBACK_ALLOW_PRIVATE is on or the host is named in CALLBACK_ALLOWED_HOSTS;
- the console's own: an address of a host the console is reached at (the host:port an API call came to,
  CONSOLE_URL), at its port always, and at any port unless the host is named in CALLBACK_ALLOWED_HOSTS.

An IPv4 address written inside an IPv6 one (::ffff:127.0.0.1, 64:ff9b::7f00:1, 2002:7f00:1::) is judged as
the IPv4 address it names. Every address of a name must pass: a name that resolves to one public and one inward
address is refused, since the connection may go to either.

`post(url, ...)` checks the URL again and connects to the addresses that check approved, never resolving the
name a second time (a name whose owner points it inward between the check and the connection, DNS rebinding,
still reaches the approved address or nothing); the request carries the URL's host in its Host header, and
https verifies the certificate against that host name (SNI too). A redirect is not followed: any answer but a
2xx is a failed delivery.

No module here imports django.http: the views (external.api) turn a Refused into a 422.
"""

from __future__ import annotations

import http.client
import ipaddress
import socket
import ssl
import urllib.parse
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from functools import partial

from django.conf import settings

_THIS_NETWORK = ipaddress.ip_network("0.0.0.0/8")
_NAT64 = ipaddress.ip_network("64:ff9b::/96")
_FORBIDDEN_CHARACTERS = {chr(c) for c in range(0x21)} | {"\x7f"}


class Refused(ValueError):
    """A URL the console will not call: `detail` says why. `transient` when the name could not be resolved for
    now (the resolver failed, not the name): the same URL may pass later."""

    def __init__(self, detail: str, *, transient: bool = False):
        super().__init__(detail)
        self.detail, self.transient = detail, transient


class DeliveryFailed(Exception):
    """The receiver answered, but not with a 2xx (a redirect included: it is not followed)."""


@dataclass(frozen=True)
class Target:
    """A checked URL: where to connect (`addresses`, in the resolver's order, at `port`) and what to ask there."""

    scheme: str
    host: str  # the URL's host (IDNA-encoded; an IPv6 literal without its brackets): the Host header, SNI
    port: int
    path: str  # the request target: path and query, percent-encoded
    addresses: tuple[str, ...]


def resolve(host: str, port: int) -> list[str]:
    """The addresses `host` resolves to (numeric forms such as 2130706433 included, as the C library reads
    them), each once, in the resolver's order. Raises socket.gaierror."""
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, proto=socket.IPPROTO_TCP)
    return list(dict.fromkeys(str(info[4][0]).split("%", 1)[0] for info in infos))


def console_hosts() -> list[str]:
    """The host:port the console is configured to be reached at (CONSOLE_URL), when it is set."""
    if not settings.CONSOLE_URL:
        return []
    url = urllib.parse.urlsplit(settings.CONSOLE_URL)
    try:
        port = url.port or (443 if url.scheme == "https" else 80)
    except ValueError:
        return []
    return [f"[{url.hostname}]:{port}" if ":" in (url.hostname or "") else f"{url.hostname}:{port}"]


def check(url: str, *, console: Iterable[str] = ()) -> Target:
    """The URL as a Target, if the console may call it; else Refused (see the module's docstring). `console`:
    the host:port strings the console is reached at (besides CONSOLE_URL, always included)."""
    target = _parse(url)
    allowed = _normal(target.host) in {_normal(host) for host in settings.CALLBACK_ALLOWED_HOSTS}
    own = [_host_port(netloc, scheme=target.scheme) for netloc in [*console, *console_hosts()]]
    own = [(host, port) for host, port in own if host]
    if (_normal(target.host), target.port) in {(_normal(host), port) for host, port in own}:
        raise Refused("must not point at this console")
    try:
        addresses = resolve(target.host, target.port)
    except (socket.gaierror, UnicodeError) as exc:
        transient = isinstance(exc, socket.gaierror) and exc.errno == socket.EAI_AGAIN
        why = "could not be resolved just now" if transient else "does not resolve"
        raise Refused(f"its host {target.host!r} {why} ({exc})", transient=transient) from None
    if not addresses:
        raise Refused(f"its host {target.host!r} resolves to no address")
    for address in addresses:
        if why := _refusal(ipaddress.ip_address(address), allowed=allowed):
            named = "" if address == target.host else f" (its host {target.host!r} resolves to {address})"
            raise Refused(f"must not point at a {why} address{named}")
    _not_the_console(target, addresses, own, allowed=allowed)
    return Target(target.scheme, target.host, target.port, target.path, tuple(addresses))


def post(url: str, body: bytes, headers: Mapping[str, str], *, timeout: float, console: Iterable[str] = ()) -> int:
    """POST `body` to `url`, checked again now (Refused), connecting only to the addresses that check approved;
    the answer's status, if a 2xx; otherwise DeliveryFailed (a 3xx is not followed). OSError: no connection."""
    target = check(url, console=console)
    if target.scheme == "https":
        connection = http.client.HTTPSConnection(
            target.host, target.port, timeout=timeout, context=ssl.create_default_context()
        )
    else:
        connection = http.client.HTTPConnection(target.host, target.port, timeout=timeout)
    # http.client opens its socket through this attribute (and then, for https, wraps it for `target.host`: SNI
    # and the certificate's name): pointed at the checked addresses, no second lookup can swap them.
    connection._create_connection = partial(_connect, target.addresses)
    try:
        connection.request("POST", target.path, body=body, headers=dict(headers))
        response = connection.getresponse()
        response.read(1024)
    finally:
        connection.close()
    if not 200 <= response.status < 300:
        redirect = " (a redirect: not followed)" if 300 <= response.status < 400 else ""
        raise DeliveryFailed(f"HTTP {response.status} {response.reason}{redirect}")
    return response.status


def _connect(addresses: tuple[str, ...], address: tuple[str, int], timeout, source_address=None) -> socket.socket:
    """socket.create_connection to each checked address in turn (the port is the URL's; the host is ignored)."""
    error: OSError | None = None
    for ip in addresses:
        try:
            return socket.create_connection((ip, address[1]), timeout, source_address)
        except OSError as exc:
            error = exc
    raise error or OSError("no address to connect to")


def _parse(url: str) -> Target:
    if any(char in _FORBIDDEN_CHARACTERS for char in url):
        raise Refused("must not contain spaces or control characters")
    try:
        parts = urllib.parse.urlsplit(url)
        port = parts.port
    except ValueError as exc:
        raise Refused(f"is not a valid URL ({exc})") from None
    if parts.scheme not in ("http", "https"):
        raise Refused("must be an http(s) URL")
    if not parts.hostname:
        raise Refused("must name a host")
    if parts.username is not None or parts.password is not None:
        raise Refused("must not carry credentials (the callback is signed: verify its signature instead)")
    if port == 0:
        raise Refused("must not name port 0")
    try:
        host = parts.hostname.encode("idna").decode("ascii") if not parts.hostname.isascii() else parts.hostname
    except UnicodeError:
        raise Refused(f"its host {parts.hostname!r} is not a valid host name") from None
    path = urllib.parse.quote(parts.path or "/", safe="/%:@!$&'()*+,;=-._~")
    if parts.query:
        path += "?" + urllib.parse.quote(parts.query, safe="/%:@!$&'()*+,;=-._~?")
    return Target(parts.scheme, host, port or (443 if parts.scheme == "https" else 80), path, ())


def _refusal(ip: ipaddress.IPv4Address | ipaddress.IPv6Address, *, allowed: bool) -> str:
    """Why the console may not connect to `ip` ("" if it may); `allowed`: its host is in CALLBACK_ALLOWED_HOSTS."""
    ip = _embedded_ipv4(ip)
    if ip.is_unspecified or ip in _THIS_NETWORK:
        return "unspecified"
    if ip.is_loopback:
        return "" if allowed else "loopback"
    if ip.is_link_local:
        return "link-local"
    if ip.is_multicast:
        return "multicast"
    if ip.is_reserved:
        return "reserved"
    if ip.is_private or not ip.is_global:
        return "" if allowed or settings.CALLBACK_ALLOW_PRIVATE else "private"
    return ""


def _embedded_ipv4(ip):
    if isinstance(ip, ipaddress.IPv6Address):
        if ip.ipv4_mapped is not None:
            return ip.ipv4_mapped
        if ip.sixtofour is not None:
            return ip.sixtofour
        if ip in _NAT64:
            return ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF)
    return ip


def _host_port(netloc: str, *, scheme: str) -> tuple[str, int]:
    """A host:port the console is reached at, as (host, port); ("", 0) if it is not one. Without a port, the
    default of the callback's scheme (a Host header does not say which scheme it came by)."""
    try:
        parts = urllib.parse.urlsplit(f"//{netloc}")
        return parts.hostname or "", parts.port or (443 if scheme == "https" else 80)
    except ValueError:
        return "", 0


def _not_the_console(target: Target, addresses: list[str], console: list[tuple[str, int]], *, allowed: bool) -> None:
    """Refused if the callback's addresses are the console's: at the console's port always, at any other port
    unless the callback's host is allowed (a receiver beside the console, named by the operator)."""
    for host, port in console:
        try:
            own = set(resolve(host, port))
        except (socket.gaierror, UnicodeError):
            continue  # a name the console is reached at but cannot resolve itself: nothing to compare with
        if own.intersection(addresses) and (port == target.port or not allowed):
            raise Refused("must not point at this console (its host resolves to the console's address)")


def _normal(host: str) -> str:
    return host.strip().strip("[]").rstrip(".").lower()
