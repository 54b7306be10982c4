"""dualpipe"""
