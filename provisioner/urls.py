from django.urls import path

from provisioner import api

urlpatterns = [
    path("api/agent/heartbeat", api.HeartbeatView.as_view(), name="api_agent_heartbeat"),
    path("api/v1/catalog", api.CatalogView.as_view(), name="api_catalog"),
    path("api/v1/sessions", api.SessionListView.as_view(), name="api_sessions"),
    path("api/v1/sessions/<str:session_id>", api.SessionDetailView.as_view(), name="api_session"),
    path("api/v1/sessions/<str:session_id>/stop", api.SessionStopView.as_view(), name="api_session_stop"),
    path(
        "api/v1/sessions/<str:session_id>/events", api.SessionEventsView.as_view(), name="api_session_events"
    ),
    path(
        "api/v1/sessions/<str:session_id>/metrics",
        api.SessionMetricsView.as_view(),
        name="api_session_metrics",
    ),
    path(
        "api/v1/sessions/<str:session_id>/notices",
        api.SessionNoticesView.as_view(),
        name="api_session_notices",
    ),
    path(
        "api/v1/sessions/<str:session_id>/still-here",
        api.SessionStillHereView.as_view(),
        name="api_session_still_here",
    ),
    path("api/v1/quota", api.QuotaView.as_view(), name="api_quota"),
    path("api/v1/admin/nodes", api.AdminNodeListView.as_view(), name="api_admin_nodes"),
    path(
        "api/v1/admin/nodes/<int:node_id>/<str:action>",
        api.AdminNodeActionView.as_view(),
        name="api_admin_node_action",
    ),
    path("api/v1/admin/quotas", api.AdminQuotaView.as_view(), name="api_admin_quotas"),
]
