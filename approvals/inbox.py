"""The reviewer inbox at `/`: pending cards of the channels the user may approve. (Issue #4: to be built.)"""

from __future__ import annotations

from console import views as console_views


def inbox(request):
    return console_views.home(request)
