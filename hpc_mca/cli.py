import click

@click.group()
def main() -> None:
    """hpc-mca"""
