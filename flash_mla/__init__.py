"""flash_mla"""
