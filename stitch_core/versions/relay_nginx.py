"""The nginx configuration of an HTTP relay (`stitch relay http`, stitch_core.versions.relay).

What is cached how, and why (docs/relays.md):

* immutable version objects (`<run>/versions/<n>/...`: patches, snapshots, manifests, span
  documents and objects) are cached whole after one upstream fetch, concurrent misses collapsed
  onto that fetch by `proxy_cache_lock`;
* the mutable documents, `<run>/latest` and `<run>/versions/<n>/spans.json` (the span index a
  squasher rewrites), are passed through to the origin on every read and never stored;
* only a 200 is ever stored (a 404 may become a version later);
* `X-Stitch-Refresh` (REFRESH_HEADER) makes the relay fetch the object from the origin again and
  replace its cached copy (`proxy_cache_bypass`: the answer is not taken from the cache, and is
  stored). A FallbackBoard sends it after the relay served a copy that did not match the
  manifest. It is honoured at most once a minute per object (`limit_req` keyed on the URI, only
  for requests that carry it; more are answered 429), so no client can make the relay fetch an
  object from the origin more than once a minute; with a refresh token only a header carrying
  the token counts (any other value is ignored: served from the cache). The header is not
  passed to the origin. No other header or argument bypasses the cache.
"""

from __future__ import annotations

import os
import pwd
import re
import urllib.parse
from pathlib import Path

from stitch_core.errors import StitchError
from stitch_core.versions.board.http import REFRESH_HEADER

DEFAULT_MAX_CACHE = "20g"
REFRESH_RATE = "1r/m"  # origin fetches a refresh may cause, per object
TOKEN_RE = re.compile(r"^[a-z0-9_-]{16,256}$")  # nginx's map compares ignoring case


class RelayConfigError(StitchError, ValueError):
    """A relay's origin URL or refresh token cannot be put in an nginx config."""


def split_origin(url: str) -> tuple[str, str, str]:
    """(scheme, host:port, path prefix without a trailing '/') of an http(s) origin URL."""
    u = urllib.parse.urlsplit(url)
    if u.scheme not in ("http", "https") or not u.netloc or u.query or u.fragment:
        raise RelayConfigError(f"not an HTTP origin URL: {url!r} (want "
                               "http(s)://host:port[/prefix])")
    prefix = u.path.rstrip("/")
    if prefix and not re.fullmatch(r"(/[A-Za-z0-9._~-]+)+", prefix):
        raise RelayConfigError(f"origin path {prefix!r}: letters, digits and ._~- only")
    return u.scheme, u.netloc, prefix


def check_token(token: str) -> str:
    """`token` if it can be a refresh token: 16-256 characters of [a-z0-9_-] (lower case: nginx
    compares map values ignoring case), e.g. `openssl rand -hex 32`."""
    if not TOKEN_RE.match(token):
        raise RelayConfigError("a refresh token is 16-256 characters of lower-case letters, "
                               "digits, '_' and '-' (e.g. `openssl rand -hex 32`)")
    return token


def nginx_config(origin: str, port: int, directory: str | os.PathLike, *,
                 host: str = "127.0.0.1", max_cache: str = DEFAULT_MAX_CACHE,
                 upstream_rate: str | None = None, refresh_token: str | None = None) -> str:
    """nginx.conf of an HTTP relay of the board at `origin` (`http(s)://host:port[/prefix]`),
    listening on host:port, keeping its cache, logs and temp files under `directory` (module
    doc). `upstream_rate` (e.g. `"12500k"`, bytes/s): nginx's `limit_rate` on the region's
    answers (a crude WAN stand-in; the fleet benchmark uses `tc` where it can).
    `refresh_token`: honour REFRESH_HEADER only when it carries this value."""
    scheme, hostport, prefix = split_origin(origin)
    d = Path(directory).expanduser().resolve()
    user = f"user {pwd.getpwuid(os.geteuid()).pw_name};" if os.geteuid() == 0 else ""
    listen = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    rate = f"limit_rate {upstream_rate};" if upstream_rate else ""
    hdr = "$http_" + REFRESH_HEADER.lower().replace("-", "_")
    honoured = f'"{check_token(refresh_token)}" 1;' if refresh_token else '"" 0; "0" 0;'
    default = "0" if refresh_token else "1"
    # the origin may sit under a path: the URI is rewritten, proxy_pass takes no URI (nginx
    # refuses one inside a regex location)
    to_origin = (f"rewrite ^ {prefix}$uri break;\n      " if prefix else "") + \
        f"proxy_pass {scheme}://stitch_origin;"
    return f"""\
# written by stitch (stitch_core/versions/relay_nginx.py): an HTTP relay of {origin}
{user}
worker_processes 1;
pid {d}/nginx.pid;
error_log {d}/error.log warn;
events {{ worker_connections 4096; }}
http {{
  log_format relay '$msec $remote_addr "$request" $status $body_bytes_sent '
                   'cache=$upstream_cache_status up_bytes=$upstream_bytes_received';
  access_log {d}/access.log relay;
  client_body_temp_path {d}/tmp/body;
  proxy_temp_path {d}/tmp/proxy;
  fastcgi_temp_path {d}/tmp/fastcgi;
  uwsgi_temp_path {d}/tmp/uwsgi;
  scgi_temp_path {d}/tmp/scgi;
  sendfile on;
  tcp_nodelay on;
  keepalive_timeout 65s;
  proxy_cache_path {d}/cache levels=1:2 keys_zone=stitch:16m max_size={max_cache}
                   inactive=30d use_temp_path=off;
  # store 200s only: a 404 may become a version later, a 206 is a piece of what we cache whole
  map $upstream_status $stitch_no_store {{ 200 0; default 1; }}
  # {REFRESH_HEADER}: fetch this object from the origin again and replace the cached copy;
  # only requests that carry it are counted, at most {REFRESH_RATE} per object (429 beyond)
  map {hdr} $stitch_refresh {{ default {default}; {honoured} }}
  map $stitch_refresh $stitch_refresh_key {{ 1 $uri; default ""; }}
  limit_req_zone $stitch_refresh_key zone=stitch_refresh:4m rate={REFRESH_RATE};
  limit_req_status 429;
  limit_req_log_level warn;
  upstream stitch_origin {{
    server {hostport};
    keepalive 32;
  }}
  server {{
    listen {listen} backlog=4096;
    proxy_http_version 1.1;
    proxy_set_header Connection "";
    proxy_set_header Host {hostport};
    proxy_set_header {REFRESH_HEADER} "";
    proxy_connect_timeout 5s;
    proxy_read_timeout 60s;
    add_header X-Stitch-Relay-Cache $upstream_cache_status always;
    # the span index is rewritten in place by the squasher: passed through, never stored
    location ~ /versions/[^/]+/spans\\.json$ {{
      {to_origin}
      proxy_cache off;
      proxy_buffering off;
    }}
    # immutable version objects (patches, snapshots, manifests, spans): one upstream fetch
    # per object, refreshed only by a rate-limited {REFRESH_HEADER}
    location ~ /versions/ {{
      {to_origin}
      proxy_cache stitch;
      proxy_cache_key $uri;
      proxy_cache_lock on;
      proxy_cache_lock_timeout 600s;
      proxy_cache_lock_age 600s;
      proxy_cache_revalidate on;
      proxy_cache_use_stale error timeout updating http_500 http_502 http_503 http_504;
      proxy_no_cache $stitch_no_store;
      proxy_cache_bypass $stitch_refresh;
      limit_req zone=stitch_refresh;
      {rate}
    }}
    # latest and anything else: straight to the origin, never stored
    location / {{
      {to_origin}
      proxy_cache off;
      proxy_buffering off;
    }}
  }}
}}
"""
