from django.conf import settings


def site(request):
    return {"SITE_NAME": "Suanli 算力", "SITE_CURRENCY": settings.SITE_CURRENCY}
