from django.urls import path

from notices import api, views

urlpatterns = [
    path("notices/", views.notice_list, name="notice_list"),
    path("notices/settings/", views.notice_settings, name="notice_settings"),
    path("notices/read-all", views.notices_read_all_view, name="notices_read_all"),
    path("notices/<int:notice_id>/read", views.notice_read_view, name="notice_read"),
    path("notices/<int:notice_id>/dismiss", views.notice_dismiss_view, name="notice_dismiss"),
    path("api/v1/notices/", api.NoticeListView.as_view(), name="api_notices"),
    path("api/v1/notices/read-all", api.NoticeReadAllView.as_view(), name="api_notices_read_all"),
    path("api/v1/notices/<int:notice_id>/read", api.NoticeReadView.as_view(), name="api_notice_read"),
    path(
        "api/v1/notices/<int:notice_id>/dismiss", api.NoticeDismissView.as_view(), name="api_notice_dismiss"
    ),
]
