"""lens"""
