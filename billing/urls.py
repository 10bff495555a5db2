from django.urls import path

from billing import api

urlpatterns = [
    path("api/v1/wallet", api.WalletView.as_view(), name="api_wallet"),
    path("api/v1/ledger", api.LedgerView.as_view(), name="api_ledger"),
    path("api/v1/wallet/topups", api.TopUpView.as_view(), name="api_topups"),
    path("api/stripe/webhook", api.stripe_webhook, name="stripe_webhook"),
    path("api/v1/cards", api.CardListView.as_view(), name="api_cards"),
    path("api/v1/cards/redeem", api.CardRedeemView.as_view(), name="api_card_redeem"),
    path("api/v1/cards/<int:card_id>", api.CardDetailView.as_view(), name="api_card"),
    path("api/v1/cards/<int:card_id>/split", api.CardSplitView.as_view(), name="api_card_split"),
    path("api/v1/cards/<int:card_id>/gift", api.CardGiftView.as_view(), name="api_card_gift"),
    path("api/v1/cards/<int:card_id>/revoke", api.CardRevokeView.as_view(), name="api_card_revoke"),
    path("api/v1/admin/prices", api.AdminPriceView.as_view(), name="api_admin_prices"),
    path("api/v1/admin/card-batches", api.AdminCardBatchListView.as_view(), name="api_admin_card_batches"),
    path(
        "api/v1/admin/card-batches/<int:batch_id>",
        api.AdminCardBatchDetailView.as_view(),
        name="api_admin_card_batch",
    ),
]
