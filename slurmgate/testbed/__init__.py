"""Local stand-ins that are not the product: GitHub emulator, stub servers, soak, cluster, demo."""
