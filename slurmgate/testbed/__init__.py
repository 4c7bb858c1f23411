"""Local stand-ins that are not the product: GitHub emulator, stub model server, load, cluster."""
