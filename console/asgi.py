import os
import warnings

from django.core.asgi import get_asgi_application

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "console.settings")
# WhiteNoise hands Django's ASGI handler a file iterator, which Django reads in a thread and warns about on
# every static file: the price of serving hashed, compressed, far-future-cached files without a CDN.
warnings.filterwarnings("ignore", message="StreamingHttpResponse must consume synchronous iterators")
application = get_asgi_application()
