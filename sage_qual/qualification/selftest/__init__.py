"""selftest"""
