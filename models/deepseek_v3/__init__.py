"""models/deepseek_v3"""
