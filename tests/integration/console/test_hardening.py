"""Production hardening: HTTPS (redirect, HSTS, behind a proxy), a Content-Security-Policy the pages satisfy (no
inline script or handler, no eval), /api/docs from our own static files (no CDN, works offline), and the demo's
fault injection in development only. On the production server: tests/system/test_hardening_server.py; in Chromium:
tests/browser/test_browser_policy.py."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from django.conf import settings as django_settings
from django.contrib.auth.models import User
from django.core.management import call_command

TEMPLATES = Path(django_settings.BASE_DIR) / "templates"

# What a strict CSP refuses: inline <script> (a JSON data block is not a script), on*= handlers, htmx's hx-on
# (run through eval), javascript: URLs, style attributes.
_INLINE_SCRIPT = re.compile(r"<script\b(?![^>]*\bsrc=)(?![^>]*type=[\"']application/json)[^>]*>", re.I)
_HANDLER = re.compile(r"\s(?:on[a-z]+|hx-on[:\w-]*)\s*=", re.I)
_JS_URL = re.compile(r"=\s*[\"']?\s*javascript:", re.I)
_STYLE_ATTR = re.compile(r"\sstyle\s*=", re.I)


def inline_code(html: str) -> list[str]:
    found = []
    for pattern in (_INLINE_SCRIPT, _HANDLER, _JS_URL, _STYLE_ATTR):
        found += [html[max(0, m.start() - 40) : m.end() + 40] for m in pattern.finditer(html)]
    return found


# --- the templates and pages satisfy the policy ---------------------------------------------------------------


@pytest.mark.parametrize("template", sorted(TEMPLATES.rglob("*.html")), ids=lambda p: str(p.relative_to(TEMPLATES)))
def test_no_template_has_inline_script_or_handlers(template):
    assert inline_code(template.read_text()) == []


def test_the_policy_allows_our_own_files_only():
    policy = django_settings.SECURE_CSP_REPORT_ONLY if django_settings.DEVELOPMENT else django_settings.SECURE_CSP
    assert policy["script-src"] == ["'self'"]
    assert policy["style-src"] == ["'self'"]
    assert policy["object-src"] == ["'none'"]
    assert policy["frame-ancestors"] == ["'none'"]
    assert not any("unsafe" in value for values in policy.values() for value in values)


@pytest.fixture
def site(db):
    call_command("demo_setup", verbosity=0)
    return {user.username: user for user in User.objects.all()}


PAGES = ["/", "/runs/", "/channels/", "/dashboard/", "/audit/", "/admin/", "/admin/auth/user/", "/api/docs"]


@pytest.mark.parametrize("path", PAGES)
def test_rendered_pages_have_no_inline_script_or_handlers(client, site, path):
    client.force_login(site["admin"])

    response = client.get(path)

    assert response.status_code == 200
    assert inline_code(response.content.decode()) == []


def test_the_login_page_has_no_inline_script_or_handlers(client, db):
    response = client.get("/accounts/login/")

    assert response.status_code == 200
    assert inline_code(response.content.decode()) == []


def test_development_reports_the_policy_without_enforcing_it_or_https(client, db):
    assert django_settings.DEVELOPMENT

    response = client.get("/accounts/login/")

    assert "script-src 'self'" in response["Content-Security-Policy-Report-Only"]
    assert "Content-Security-Policy" not in response
    assert "Strict-Transport-Security" not in response
    assert response.status_code == 200  # no redirect to https


# --- /api/docs --------------------------------------------------------------------------------------------------

_ASSET = re.compile(r"""(?:src|href)=["']([^"']+)["']""")


def test_the_docs_page_references_no_other_host(client, db):
    response = client.get("/api/docs")

    assert response.status_code == 200
    html = response.content.decode()
    assert "://" not in html and "cdn" not in html.lower()
    assets = _ASSET.findall(html)
    assert any(a.endswith("swagger-ui-bundle.js") for a in assets)
    assert all(a.startswith("/static/") for a in assets), assets


# --- the demo's faults ------------------------------------------------------------------------------------------------


def test_the_demo_faults_are_honoured_in_development_only():
    assert django_settings.DEMO_FAULTS_ENABLED is django_settings.DEVELOPMENT
