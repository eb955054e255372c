from setuptools import setup

setup(name="parity-probe", version="0.1", packages=["parity_probe"])
