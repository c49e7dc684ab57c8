import os
import warnings

from django.core.asgi import get_asgi_application

from console.body_limit import BodyLimit

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "console.settings")
# WhiteNoise hands Django's ASGI handler a file iterator, which Django reads in a thread and warns about on
# every static file: the price of serving hashed, compressed, far-future-cached files without a CDN.
warnings.filterwarnings("ignore", message="StreamingHttpResponse must consume synchronous iterators")
# The body limit wraps Django: Django's handler reads the whole body before any middleware could refuse it.
application = BodyLimit(get_asgi_application())
