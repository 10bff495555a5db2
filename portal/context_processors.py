from django.conf import settings


def site(request):
    return {
        "SITE_NAME": "Suanli 算力",
        "SITE_CURRENCY": settings.SITE_CURRENCY,
        "SSO_ENABLED": bool(settings.OIDC_ISSUER),
        "SSO_PROVIDER_NAME": settings.OIDC_PROVIDER_NAME,
        "LOCAL_PASSWORDS": settings.LOCAL_PASSWORDS,
    }
