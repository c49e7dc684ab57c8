"""Django as a WSGI application, behind the body limit: for a WSGI server. The production server serves
console/asgi.py, whose sync views run through this same stack (WSGI in a pool of threads)."""

import os

from django.core.wsgi import get_wsgi_application

from console.body_limit import WsgiBodyLimit

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "console.settings")
# The body limit wraps Django, which would otherwise read a chunked body whole (console/body_limit.py).
application = WsgiBodyLimit(get_wsgi_application())
