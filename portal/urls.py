from django.contrib import admin
from django.contrib.auth import views as auth_views
from django.urls import include, path
from drf_spectacular.views import SpectacularAPIView, SpectacularSwaggerView

from portal import api, file_pages, files_api, metrics, pages, report_pages, session_pages, views

urlpatterns = [
    path("", views.home, name="home"),
    path("livez", views.livez, name="livez"),
    path("readyz", views.readyz, name="readyz"),
    path("healthz", views.readyz, name="healthz"),  # readiness, by its older name
    path("metrics", metrics.metrics, name="metrics"),
    path("signup/", views.signup, name="signup"),
    path("signup/pending/", views.signup_pending, name="signup_pending"),
    path("signup/pending/resend/", views.signup_resend, name="signup_resend"),
    path("signup/verify/<str:token>/", views.signup_verify, name="signup_verify"),
    path("login/", views.ThrottledLoginView.as_view(), name="login"),
    path("logout/", auth_views.LogoutView.as_view(), name="logout"),
    path("oidc/", include("mozilla_django_oidc.urls")),
    path("password/reset/", auth_views.PasswordResetView.as_view(), name="password_reset"),
    path("password/reset/sent/", auth_views.PasswordResetDoneView.as_view(), name="password_reset_done"),
    path(
        "password/reset/<uidb64>/<token>/",
        auth_views.PasswordResetConfirmView.as_view(),
        name="password_reset_confirm",
    ),
    path(
        "password/reset/done/", auth_views.PasswordResetCompleteView.as_view(), name="password_reset_complete"
    ),
    path("password/change/", auth_views.PasswordChangeView.as_view(), name="password_change"),
    path("password/change/done/", auth_views.PasswordChangeDoneView.as_view(), name="password_change_done"),
    path("dashboard/", pages.dashboard, name="dashboard"),
    path("wallet/", pages.wallet, name="wallet"),
    path("wallet/statement.csv", pages.wallet_statement_csv, name="wallet_statement_csv"),
    path("live/funds", pages.funds_live, name="funds_live"),
    path("live/dashboard", pages.dashboard_live, name="dashboard_live"),
    path("cards/", pages.cards, name="cards"),
    path("files/", file_pages.files, name="files"),
    path("files/delete", file_pages.files_delete, name="files_delete"),
    path("launch/", session_pages.launch, name="launch"),
    path("sessions/", session_pages.session_list, name="session_list"),
    path("sessions/<uuid:session_id>/", session_pages.session_detail, name="session_detail"),
    path("sessions/<uuid:session_id>/live", session_pages.session_live, name="session_live"),
    path("sessions/<uuid:session_id>/stop", session_pages.session_stop_view, name="session_stop"),
    path(
        "sessions/<uuid:session_id>/still-here",
        session_pages.session_still_here_view,
        name="session_still_here",
    ),
    path("live/sessions", session_pages.running_live, name="running_live"),
    path("operations/", session_pages.operations, name="operations"),
    path("operations/usage/", report_pages.usage_report_site, name="usage_report"),
    path("operations/audit/", report_pages.audit_log, name="audit_log"),
    path("profile/", views.profile, name="profile"),
    path("language/", views.language_set, name="language_set"),
    path("teams/", views.team_list, name="team_list"),
    path("teams/join/", views.team_join, name="team_join"),
    path("teams/join/<str:code>/", views.team_join, name="team_join_code"),
    path("teams/<slug:slug>/", views.team_detail, name="team_detail"),
    path("teams/<slug:slug>/usage/", report_pages.usage_report_team, name="team_usage_report"),
    path("", include("billing.urls")),
    path("", include("provisioner.urls")),
    path("", include("notices.urls")),
    path("api/v1/me", api.MeView.as_view(), name="api_me"),
    path("api/v1/files", files_api.FileListView.as_view(), name="api_files"),
    path("api/v1/files/download", files_api.FileDownloadView.as_view(), name="api_file_download"),
    path("api/v1/files/uploads", files_api.UploadListView.as_view(), name="api_uploads"),
    path("api/v1/files/uploads/<str:upload_id>", files_api.UploadDetailView.as_view(), name="api_upload"),
    path("api/v1/tokens", api.TokenListView.as_view(), name="api_tokens"),
    path("api/v1/tokens/<int:token_id>", api.TokenDetailView.as_view(), name="api_token"),
    path("api/v1/teams", api.TeamListView.as_view(), name="api_teams"),
    path("api/v1/teams/join", api.TeamJoinView.as_view(), name="api_team_join"),
    path("api/v1/teams/<slug:slug>", api.TeamDetailView.as_view(), name="api_team"),
    path("api/v1/teams/<slug:slug>/leave", api.TeamLeaveView.as_view(), name="api_team_leave"),
    path("api/v1/teams/<slug:slug>/invites", api.TeamInviteListView.as_view(), name="api_team_invites"),
    path(
        "api/v1/teams/<slug:slug>/invites/<int:invite_id>",
        api.TeamInviteDetailView.as_view(),
        name="api_team_invite",
    ),
    path(
        "api/v1/teams/<slug:slug>/members/<int:user_id>", api.TeamMemberView.as_view(), name="api_team_member"
    ),
    path(
        "api/v1/teams/<slug:slug>/members/<int:user_id>/cap",
        api.TeamMemberCapView.as_view(),
        name="api_team_member_cap",
    ),
    path(
        "api/v1/teams/<slug:slug>/members/<int:user_id>/folder",
        api.TeamMemberFolderView.as_view(),
        name="api_team_member_folder",
    ),
    path("api/schema/", SpectacularAPIView.as_view(), name="api_schema"),
    path("api/docs/", SpectacularSwaggerView.as_view(url_name="api_schema"), name="api_docs"),
    path("admin/", admin.site.urls),
]
handler404 = "portal.views.not_found"
